"""A minimal ctypes driver for the libespeak-ng bundled by espeakng-loader.

espeak-ng keeps global state, so each process initializes it once (`Espeak.instance()`); the
synthesizer call is synchronous and collects the int16 samples its callback hands back.
"""

from __future__ import annotations

import ctypes
import os

import espeakng_loader
import numpy as np

AUDIO_OUTPUT_SYNCHRONOUS = 2
POS_CHARACTER = 1
CHARS_UTF8 = 1
RATE, VOLUME, PITCH, RANGE, PUNCTUATION, CAPITALS, WORDGAP = 1, 2, 3, 4, 5, 6, 7

_CALLBACK = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.POINTER(ctypes.c_short), ctypes.c_int, ctypes.c_void_p
)


class Espeak:
    _instance: Espeak | None = None
    _pid: int = -1

    def __init__(self) -> None:
        self.lib = ctypes.CDLL(espeakng_loader.get_library_path())
        self.lib.espeak_Initialize.restype = ctypes.c_int
        self.lib.espeak_Initialize.argtypes = [
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_int,
        ]
        data = espeakng_loader.get_data_path().encode()
        self.sample_rate = self.lib.espeak_Initialize(AUDIO_OUTPUT_SYNCHRONOUS, 0, data, 0)
        if self.sample_rate <= 0:
            raise RuntimeError(f"espeak_Initialize failed ({self.sample_rate})")
        self._chunks: list[np.ndarray] = []
        self._callback = _CALLBACK(self._collect)  # kept alive: espeak holds the pointer
        self.lib.espeak_SetSynthCallback(self._callback)
        self.lib.espeak_ng_SetRandSeed.argtypes = [ctypes.c_long]
        self.lib.espeak_SetVoiceByName.argtypes = [ctypes.c_char_p]
        self.lib.espeak_SetParameter.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
        self.lib.espeak_Synth.argtypes = [
            ctypes.c_char_p, ctypes.c_size_t, ctypes.c_uint, ctypes.c_int, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ]  # fmt: skip

    @classmethod
    def instance(cls) -> Espeak:
        # One per process (a forked worker must initialize its own).
        if cls._instance is None or cls._pid != os.getpid():
            cls._instance, cls._pid = Espeak(), os.getpid()
        return cls._instance

    def _collect(self, samples, n: int, events) -> int:
        if n > 0:
            self._chunks.append(np.ctypeslib.as_array(samples, shape=(n,)).copy())
        return 0

    def synth(self, text: str, voice: str, rate: int = 175, pitch: int = 50, range_: int = 50,
              wordgap: int = 0, seed: int = 0) -> np.ndarray:  # fmt: skip
        """int16 samples at `self.sample_rate` for `text` spoken by `voice` (e.g. "en-us+m3"),
        with espeak's noise seeded by `seed`."""
        self.lib.espeak_ng_SetRandSeed(seed)  # breath/frication noise
        if self.lib.espeak_SetVoiceByName(voice.encode()) != 0:
            raise ValueError(f"espeak-ng has no voice {voice!r}")
        for param, value in ((RATE, rate), (PITCH, pitch), (RANGE, range_), (WORDGAP, wordgap)):
            self.lib.espeak_SetParameter(param, int(value), 0)
        self._chunks = []
        data = text.encode() + b"\0"
        err = self.lib.espeak_Synth(data, len(data), 0, POS_CHARACTER, 0, CHARS_UTF8, None, None)
        if err != 0:
            raise RuntimeError(f"espeak_Synth failed ({err}) for {text[:40]!r}")
        if not self._chunks:
            return np.zeros(0, np.int16)
        return np.concatenate(self._chunks)


def espeak_version() -> str:
    """The version of the bundled libespeak-ng (espeak_Info needs no initialization)."""
    lib = ctypes.CDLL(espeakng_loader.get_library_path())
    lib.espeak_Info.restype = ctypes.c_char_p
    lib.espeak_Info.argtypes = [ctypes.c_void_p]
    return lib.espeak_Info(None).decode()

"""The CTC transformer of the paper (App. F), in one readable file.

    feats [B, T, 80] ──conv1d(k=7, s=3)──> [B, T', dim] + CAPE positions
        ──> N × pre-LayerNorm blocks (self-attention with a key padding mask, GELU MLP)
        ──> LayerNorm ──> linear ──> log_softmax ──> CTC

Positions are CAPE (Likhomanenko et al., 2021, "continuous augmented positional embeddings"),
in units of output frames (30 ms after the stride-3 conv), centred on each utterance's own middle
frame so that padding never moves them:

    eval:  p_i = i − (len − 1)/2                              (plain centred sinusoidal)
    train: p_i = (i − (len − 1)/2 + Δ + ε_i) · λ
           Δ ~ U(−cape_global_shift, +cape_global_shift)      per utterance, default 60 frames
           ε_i ~ U(−cape_local_shift/2, +cape_local_shift/2)   per frame,     default 1 frame
           log λ ~ U(−log cape_global_scaling, +log ...)      per utterance, default 1.1

and the embedding is [sin(p·ω_k), cos(p·ω_k)] with ω_k = 10000^(−2k/dim), added to the conv
output. Global shift makes absolute positions useless, so the model learns relative ones; the
local shift and scaling make it robust to speaking rate.

Layer drop skips each block with probability `layer_drop` during training (one draw per block
per batch; compiled, the block runs and the draw discards its output, so its FLOPs are spent).
On CUDA the encoder runs under bf16 autocast; log-probabilities are float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pflbench.errors import UserError


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    layers: int
    heads: int
    mlp: int
    dropout: float
    layer_drop: float
    n_mels: int = 80
    conv_kernel: int = 7
    conv_stride: int = 3
    cape_global_shift: float = 60.0  # output frames
    cape_local_shift: float = 1.0  # output frames
    cape_global_scaling: float = 1.1


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(dim=64, layers=2, heads=2, mlp=128, dropout=0.0, layer_drop=0.0),
    "synth-cpu": ModelConfig(dim=144, layers=4, heads=4, mlp=576, dropout=0.0, layer_drop=0.0),
    # 4.89M parameters: the embedded task's v5 model (docs/RESULTS.md, "Model size").
    "synth-cpu-m": ModelConfig(dim=256, layers=6, heads=4, mlp=1024, dropout=0.0, layer_drop=0.0),
    "paper-255m": ModelConfig(dim=768, layers=36, heads=4, mlp=3072, dropout=0.3, layer_drop=0.3),
}


# ----------------------------------------------------------------------------------------------
# Positions


def cape_positions(
    out_lens: Tensor,
    frames: int,
    cfg: ModelConfig,
    training: bool,
    generator: torch.Generator | None = None,
) -> Tensor:
    """[B, frames] positions centred per utterance; augmented (global/local shift, scaling) in
    training, drawn from `generator` (default: the global RNG)."""
    pos = torch.arange(frames, device=out_lens.device, dtype=torch.float32)
    pos = pos[None, :] - (out_lens[:, None].float() - 1) / 2
    if not training:
        return pos
    batch = out_lens.shape[0]

    def uniform(shape: tuple[int, ...], bound: float) -> Tensor:
        draw = torch.rand(shape, device=out_lens.device, generator=generator)
        return (draw * 2 - 1) * bound

    shift = uniform((batch, 1), cfg.cape_global_shift)
    jitter = uniform((batch, frames), cfg.cape_local_shift / 2)
    scale = torch.exp(uniform((batch, 1), math.log(cfg.cape_global_scaling)))
    return (pos + shift + jitter) * scale


def sinusoids(pos: Tensor, dim: int) -> Tensor:
    """[B, T] positions → [B, T, dim] = [sin(p·ω), cos(p·ω)], ω_k = 10000^(−2k/dim)."""
    omega = torch.exp(
        torch.arange(0, dim, 2, device=pos.device, dtype=torch.float32) * (-math.log(1e4) / dim)
    )
    angles = pos[..., None] * omega
    return torch.cat([angles.sin(), angles.cos()], dim=-1)


# ----------------------------------------------------------------------------------------------
# The encoder


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        """x [B, T, dim]; keep [B, 1, 1, T] is True at real (non-padding) key frames."""
        B, T, D = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, D))


class Block(nn.Module):
    """Pre-LayerNorm: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.dim)
        self.attn = SelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.dim, cfg.mlp),
            nn.GELU(),
            nn.Dropout(cfg.dropout),
            nn.Linear(cfg.mlp, cfg.dim),
        )
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        x = x + self.drop(self.attn(self.ln_attn(x), keep))
        return x + self.drop(self.mlp(self.ln_mlp(x)))


class CTCTransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int):
        super().__init__()
        if cfg.dim % cfg.heads or (cfg.dim // cfg.heads) % 2:
            raise UserError(f"model dim {cfg.dim} must split into {cfg.heads} even-sized heads")
        self.cfg = cfg
        self.vocab_size = vocab_size
        self.conv = nn.Conv1d(
            cfg.n_mels,
            cfg.dim,
            cfg.conv_kernel,
            stride=cfg.conv_stride,
            padding=cfg.conv_kernel // 2,
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_out = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, vocab_size)

    def output_lengths(self, feat_lens: Tensor) -> Tensor:
        k, s = self.cfg.conv_kernel, self.cfg.conv_stride
        return (feat_lens + 2 * (k // 2) - k) // s + 1

    def forward(
        self, feats: Tensor, feat_lens: Tensor, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """feats [B, T, n_mels] (any padding), feat_lens [B] → log-probs [B, T', V] float32,
        out_lens [B]. Outputs at frames ≥ out_lens are meaningless. `positions` [B, T'] replaces
        the CAPE positions drawn here (the multi-client trainer draws them per client)."""
        frames_in = torch.arange(feats.shape[1], device=feats.device)
        # Zero the padding so the conv sees the same input as for the unpadded utterance.
        feats = feats * (frames_in[None, :] < feat_lens[:, None]).unsqueeze(-1).to(feats.dtype)
        out_lens = self.output_lengths(feat_lens)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=feats.is_cuda):
            x = self.conv(feats.transpose(1, 2)).transpose(1, 2)
            frames = x.shape[1]
            if positions is None:
                positions = cape_positions(out_lens, frames, self.cfg, self.training)
            x = x + sinusoids(positions, x.shape[-1])
            x = self.drop(x)
            keep = (torch.arange(frames, device=x.device)[None, :] < out_lens[:, None])[
                :, None, None
            ]
            drop = self.cfg.layer_drop if self.training else 0.0
            for block in self.blocks:
                if drop == 0:
                    x = block(x, keep)
                elif torch.compiler.is_compiling():
                    # Branching on a draw breaks the graph once per block (and under CUDA graphs,
                    # each pattern of skipped blocks is graphs of its own): compiled, every block
                    # runs and the draw selects its output.
                    dropped = torch.rand((), device=x.device) < drop
                    x = torch.where(dropped, x, block(x, keep))
                elif torch.rand(()) >= drop:  # eagerly a dropped block is skipped
                    x = block(x, keep)
            logits = self.head(self.ln_out(x))
        return F.log_softmax(logits.float(), dim=-1), out_lens


def build_model(
    preset: str, vocab_size: int, dropout: float | None = None, layer_drop: float | None = None
) -> CTCTransformer:
    if preset not in PRESETS:
        raise UserError(f"unknown model preset {preset!r}; known presets: {', '.join(PRESETS)}")
    cfg = PRESETS[preset]
    overrides = {"dropout": dropout, "layer_drop": layer_drop}
    cfg = ModelConfig(**{**cfg.__dict__, **{k: v for k, v in overrides.items() if v is not None}})
    return CTCTransformer(cfg, vocab_size)


# ----------------------------------------------------------------------------------------------
# Loss, decoding, cost


def ctc_losses(log_probs: Tensor, out_lens: Tensor, targets: Tensor, target_lens: Tensor) -> Tensor:
    """[B] each utterance's CTC loss (summed over its frames); blank = 0. Infeasible alignments
    (too few frames) give 0 rather than inf. Under torch.compile it is one opaque operator
    (`compiled_ctc_losses`): the same kernels, so the same floats, without a graph break."""
    if torch.compiler.is_compiling():
        return compiled_ctc_losses(log_probs, out_lens, targets, target_lens)
    return F.ctc_loss(
        log_probs.transpose(0, 1),
        targets,
        out_lens,
        target_lens,
        blank=0,
        reduction="none",
        zero_infinity=True,
    )


# aten's CTC sizes its saved alphas by the longest target, a value in a tensor, so torch.compile
# cannot trace it (a graph break). These two operators hide it: the forward and the backward call
# the kernels of F.ctc_loss(reduction="none", zero_infinity=True) and of its autograd (which
# zeroes the gradient of an infinite loss), the backward computing the alphas again. On CUDA
# those kernels copy lengths between host and device (a host sync), so CUDA graphs must leave
# them out (cudagraph_unsafe: inductor's graph partitions replay the rest).
@torch.library.custom_op(
    "pflbench::ctc_losses", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)
def compiled_ctc_losses(
    log_probs: Tensor, out_lens: Tensor, targets: Tensor, target_lens: Tensor
) -> Tensor:
    nll, _ = torch.ops.aten._ctc_loss.Tensor(
        log_probs.transpose(0, 1), targets, out_lens, target_lens, 0, True
    )
    return torch.where(nll == math.inf, 0.0, nll)


@compiled_ctc_losses.register_fake
def _(log_probs: Tensor, out_lens: Tensor, targets: Tensor, target_lens: Tensor) -> Tensor:
    return log_probs.new_empty(log_probs.shape[0])


@torch.library.custom_op(
    "pflbench::ctc_losses_backward", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,)
)
def _ctc_losses_backward(
    grad: Tensor, log_probs: Tensor, out_lens: Tensor, targets: Tensor, target_lens: Tensor
) -> Tensor:
    by_time = log_probs.transpose(0, 1)
    nll, alphas = torch.ops.aten._ctc_loss.Tensor(by_time, targets, out_lens, target_lens, 0, True)
    return torch.ops.aten._ctc_loss_backward.Tensor(
        grad, by_time, targets, out_lens, target_lens, nll, alphas, 0, True
    ).transpose(0, 1)


@_ctc_losses_backward.register_fake
def _(
    grad: Tensor, log_probs: Tensor, out_lens: Tensor, targets: Tensor, target_lens: Tensor
) -> Tensor:
    batch, frames, vocab = log_probs.shape
    return log_probs.new_empty(frames, batch, vocab).transpose(0, 1)  # the kernel's layout


def _save_ctc_inputs(ctx, inputs: tuple, output: Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _ctc_losses_grad(ctx, grad: Tensor) -> tuple:
    return _ctc_losses_backward(grad, *ctx.saved_tensors), None, None, None


compiled_ctc_losses.register_autograd(_ctc_losses_grad, setup_context=_save_ctc_inputs)


def ctc_loss(log_probs: Tensor, out_lens: Tensor, targets: Tensor, target_lens: Tensor) -> Tensor:
    """Mean over the batch of each utterance's CTC loss."""
    return ctc_losses(log_probs, out_lens, targets, target_lens).mean()


def greedy_ids(log_probs: Tensor, out_lens: Tensor, blank: int = 0) -> list[list[int]]:
    """Best path: argmax per frame, merge repeats, drop blanks and padding frames."""
    best = log_probs.argmax(-1)
    prev = F.pad(best[:, :-1], (1, 0), value=-1)
    frames = torch.arange(best.shape[1], device=best.device)
    emit = (best != prev) & (best != blank) & (frames[None, :] < out_lens[:, None])
    return [row[mask].tolist() for row, mask in zip(best.cpu(), emit.cpu(), strict=True)]


def greedy_decode(log_probs: Tensor, out_lens: Tensor, tokenizer) -> list[str]:
    """Best-path transcripts, whitespace normalized as references are: the path may emit a space
    at either end or two in a row (a blank between them), which CER would count as errors of
    characters no reference has (numerics v3)."""
    ids = greedy_ids(log_probs, out_lens, tokenizer.blank)
    return [" ".join(tokenizer.decode(row).split()) for row in ids]


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def model_flops_per_frame(
    cfg: ModelConfig, vocab_size: int = 30, frames: int = 0, layers: float | None = None
) -> float:
    """Training FLOPs per output frame, nanoGPT style: 6·N (forward + backward of every weight,
    the conv frontend included since it runs once per output frame) plus 12·layers·dim·frames
    for attention scores over `frames` keys. `layers` is the number of blocks that run (default
    all; with layer drop p, training runs (1 − p)·layers of them on average)."""
    layers = cfg.layers if layers is None else layers
    per_layer = 4 * cfg.dim * cfg.dim + 2 * cfg.dim * cfg.mlp
    weights = layers * per_layer + cfg.n_mels * cfg.conv_kernel * cfg.dim + cfg.dim * vocab_size
    return 6.0 * weights + 12.0 * layers * cfg.dim * frames


def training_layers(cfg: ModelConfig) -> float:
    """Blocks a training forward runs on average: layer drop skips each with probability p."""
    return cfg.layers * (1.0 - cfg.layer_drop)

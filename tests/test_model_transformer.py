"""The CTC transformer: size, masks, CAPE, decoding, and an end-to-end overfit."""

import pytest
import torch

from pflbench.data.text import tokenizer_for
from pflbench.errors import UserError
from pflbench.evaluate import Transcript, score
from pflbench.model import (
    PRESETS,
    build_model,
    count_parameters,
    ctc_loss,
    greedy_decode,
    greedy_ids,
    model_flops_per_frame,
)
from pflbench.model.transformer import cape_positions


def test_paper_preset_has_255m_parameters():
    with torch.device("meta"):
        model = build_model("paper-255m", vocab_size=30)
    assert abs(count_parameters(model) - 255e6) / 255e6 < 0.01
    cfg = PRESETS["paper-255m"]
    assert (cfg.layers, cfg.dim, cfg.heads, cfg.mlp) == (36, 768, 4, 3072)


def test_flops_per_frame_counts_every_weight_matrix():
    model = build_model("tiny", vocab_size=30)
    weights = sum(p.numel() for p in model.parameters() if p.ndim > 1)
    assert model_flops_per_frame(model.cfg, 30) == pytest.approx(6 * weights)


def test_unknown_preset_is_a_user_error():
    with pytest.raises(UserError, match="synth-cpu"):
        build_model("huge", vocab_size=30)


def test_overrides_of_dropout_and_layer_drop():
    model = build_model("synth-cpu", 30, dropout=0.0, layer_drop=0.2)
    assert (model.cfg.dropout, model.cfg.layer_drop) == (0.0, 0.2)
    assert model.cfg.dim == PRESETS["synth-cpu"].dim


def test_shapes_and_output_lengths():
    model = build_model("tiny", vocab_size=30).eval()
    log_probs, out_lens = model(torch.randn(2, 100, 80), torch.tensor([100, 37]))
    assert log_probs.shape == (2, 34, 30) and log_probs.dtype == torch.float32
    assert out_lens.tolist() == [34, 13]  # ceil(T / 3) with kernel 7, padding 3, stride 3
    assert torch.allclose(log_probs.exp().sum(-1), torch.ones(2, 34), atol=1e-5)


def test_padded_batch_equals_unpadded_items():
    torch.manual_seed(0)
    model = build_model("tiny", vocab_size=30).eval()
    lens = torch.tensor([90, 61, 20])
    feats = torch.randn(3, 90, 80)  # garbage in the padding must not leak into outputs
    batched, out_lens = model(feats, lens)
    for i, n in enumerate(lens.tolist()):
        alone, alone_len = model(feats[i : i + 1, :n], lens[i : i + 1])
        assert alone_len.item() == out_lens[i].item()
        torch.testing.assert_close(batched[i, : alone_len.item()], alone[0], atol=1e-5, rtol=1e-5)


def test_cape_is_deterministic_in_eval_and_varies_in_train():
    cfg = PRESETS["tiny"]
    lens = torch.tensor([10, 7])
    eval_pos = cape_positions(lens, 10, cfg, training=False)
    assert torch.equal(eval_pos, cape_positions(lens, 10, cfg, training=False))
    assert eval_pos[0, :10].tolist() == [i - 4.5 for i in range(10)]  # centred on each utterance
    assert eval_pos[1, :7].tolist() == [i - 3.0 for i in range(7)]
    assert not torch.equal(cape_positions(lens, 10, cfg, True), cape_positions(lens, 10, cfg, True))

    model = build_model("tiny", vocab_size=30)  # tiny has no dropout: differences are CAPE's
    feats, feat_lens = torch.randn(2, 30, 80), torch.tensor([30, 21])
    model.eval()
    torch.testing.assert_close(model(feats, feat_lens)[0], model(feats, feat_lens)[0])
    model.train()
    assert not torch.allclose(model(feats, feat_lens)[0], model(feats, feat_lens)[0])


def test_greedy_ids_merge_repeats_drop_blanks_and_padding():
    frames = torch.tensor([[5, 5, 0, 5, 7, 7, 0, 3], [2, 0, 2, 2, 9, 9, 9, 9]])
    log_probs = torch.nn.functional.one_hot(frames, 10).float().log()
    assert greedy_ids(log_probs, torch.tensor([8, 4])) == [[5, 5, 7, 3], [2, 2]]


def test_greedy_transcripts_have_whitespace_normalized_as_references():
    """A path emitting a space first, two spaces apart (a blank between) and a space last gives the
    words with single spaces: CER does not count spaces no normalized reference can have."""
    tok = tokenizer_for("en")
    space, a, b = tok.encode(" ab")
    frames = torch.tensor([[space, a, space, 0, space, b, space]])
    log_probs = torch.nn.functional.one_hot(frames, tok.size).float().log()
    assert greedy_ids(log_probs, torch.tensor([7]), tok.blank) == [
        [space, a, space, space, b, space]
    ]
    raw = tok.decode([space, a, space, space, b, space])
    assert score([Transcript("u", "s", "a b", raw)])["cer"] > 0
    (hypothesis,) = greedy_decode(log_probs, torch.tensor([7]), tok)
    assert hypothesis == "a b" and score([Transcript("u", "s", "a b", hypothesis)])["cer"] == 0


def test_ctc_loss_is_mean_of_per_utterance_losses_and_never_infinite():
    log_probs = torch.randn(2, 5, 6).log_softmax(-1)
    targets = torch.tensor([[1, 2, 0, 0, 0, 0, 0], [3, 3, 3, 3, 3, 3, 3]])  # 2nd: infeasible
    loss = ctc_loss(log_probs, torch.tensor([5, 5]), targets, torch.tensor([2, 7]))
    first = ctc_loss(log_probs[:1], torch.tensor([5]), targets[:1], torch.tensor([2]))
    assert torch.isfinite(loss) and loss.item() == pytest.approx(first.item() / 2, rel=1e-5)


def pattern_features(token_ids: list[int], table: torch.Tensor, frames_per_token: int = 6):
    """A synthetic 'utterance': each token is a fixed random spectrum held for a few frames."""
    feats = table[torch.tensor(token_ids)].repeat_interleave(frames_per_token, dim=0)
    return feats + 0.1 * torch.randn_like(feats)


def test_small_model_overfits_a_few_utterances_to_zero_wer():
    torch.manual_seed(0)
    tok = tokenizer_for("en")
    texts = ["the cat sat", "a dog ran home", "big red fox", "we sing"]
    table = torch.randn(tok.size, 80)
    ids = [tok.encode(t) for t in texts]
    utts = [pattern_features(i, table) for i in ids]
    lens = torch.tensor([len(u) for u in utts])
    feats = torch.nn.utils.rnn.pad_sequence(utts, batch_first=True)
    targets = torch.nn.utils.rnn.pad_sequence([torch.tensor(i) for i in ids], batch_first=True)
    target_lens = torch.tensor([len(i) for i in ids])

    model = build_model("tiny", vocab_size=tok.size)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(400):
        model.train()
        loss = ctc_loss(*model(feats, lens), targets, target_lens)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 25 == 24:
            model.eval()
            with torch.no_grad():
                hyps = greedy_decode(*model(feats, lens), tok)
            if hyps == texts:
                break
    result = score(
        [Transcript(str(i), "spk", r, h) for i, (r, h) in enumerate(zip(texts, hyps, strict=True))]
    )
    assert result["wer"] == 0.0 and result["cer"] == 0.0, hyps


def test_bench_model_reports_the_weights_it_trained_and_the_kernels_it_ran():
    """`pflbench bench model` on CPU: the same steps give the same weights' digest (what two
    machines or kernel settings compare), and the kernels are this process's."""
    from pflbench.model.bench import bench_model

    first, again = (bench_model(preset="tiny", steps=2) for _ in range(2))
    assert first["weights_digest"] == again["weights_digest"]
    assert len(first["weights_digest"]) == 16 and first["cpu_seconds_per_step"] > 0
    assert first["kernels"]["aten_capability"] == torch.backends.cpu.get_cpu_capability()
    assert first["kernels"]["onednn_enabled"] == torch.backends.mkldnn.enabled


def test_bench_model_times_the_compiled_step_against_the_eager_one():
    from pflbench.model.bench import bench_model

    figures = bench_model(preset="tiny", steps=2, compile_backend="aot_eager")
    compiled = figures["compiled"]
    assert compiled["backend"] == "aot_eager" and len(compiled["weights_digest"]) == 16
    assert figures["compile_speedup"] == figures["step_seconds"] / compiled["step_seconds"]
    assert compiled["first_step_seconds"] > compiled["step_seconds"] > 0  # compilation first

"""The trained tiny checkpoint (`hy3c.checkpoint.train_tiny`): it loads and compiles like any checkpoint,
its MTP layer drafts what the main model then predicts on held-out text, training is bit-reproducible,
and the differentiable training forward is the inference model's math."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from hy3c.checkpoint import train_tiny as tt
from hy3c.checkpoint.loader import load_model
from hy3c.compiler.driver import compile_artifact
from hy3c.model import SeqChunk, allocate_kv_cache, build_step_batch
from hy3c.program.artifact import open_artifact
from hy3c.recipe import load_recipe


def test_trained_checkpoint_loads_and_compiles(trained_ckpt, tmp_path):
    model = load_model(trained_ckpt, progress=False)
    cfg = model.config
    assert model.dtype == torch.float32
    assert cfg.num_attention_heads > cfg.num_key_value_heads  # GQA
    assert cfg.layer_types[0] == "dense" and "sparse" in cfg.layer_types
    assert cfg.num_nextn_predict_layers == 1 and cfg.num_shared_experts == 1
    assert (trained_ckpt / "tokenizer.json").is_file()
    summary = compile_artifact(
        load_recipe("cpu-reference"), tmp_path / "art", checkpoint=trained_ckpt, progress=False
    )
    assert open_artifact(summary.out).recipe.name == "cpu-reference"
    assert summary.weights_bytes > 0


def _most_frequent_share(model_dir: Path, files: list[Path], max_tokens: int) -> float:
    """Accuracy of always guessing the held-out text's most frequent token (a generous chance level)."""
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = [i for f in files for i in tok.encode(f.read_text(encoding="utf-8", errors="replace")).ids]
    ids = ids[:max_tokens]
    return Counter(ids).most_common(1)[0][1] / len(ids)


def test_heldout_mtp_acceptance_and_main_accuracy(trained_ckpt):
    heldout = tt.stdlib_files()[1]
    report = tt.evaluate(trained_ckpt, heldout, max_tokens=8192)
    chance = _most_frequent_share(trained_ckpt, heldout, 8192)
    print(
        f"held-out: MTP acceptance {report.acceptance:.3f}, main accuracy {report.main_accuracy:.3f}, "
        f"MTP accuracy (x_t+2) {report.mtp_accuracy:.3f}, most-frequent-token share {chance:.3f}, "
        f"{report.positions} positions"
    )
    assert report.positions >= 8000
    assert report.acceptance >= 0.5
    assert report.main_accuracy >= 3 * chance
    assert report.mtp_accuracy >= 2 * chance  # the MTP predicts the token after next, not noise
    assert tt.mtp_acceptance(trained_ckpt, heldout, max_tokens=512) == pytest.approx(
        tt.evaluate(trained_ckpt, heldout, max_tokens=512).acceptance
    )


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_training_is_deterministic(tmp_path):
    runs = [
        tt.train_tiny(tmp_path / name, steps=3, seed=seed, progress=False)
        for name, seed in (("a", 0), ("b", 0), ("c", 1))
    ]
    a, b, c = (_weights(r.path) for r in runs)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name].view(torch.uint8), b[name].view(torch.uint8)), name
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])  # the seed matters
    assert (tmp_path / "a" / "config.json").read_bytes() == (tmp_path / "b" / "config.json").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "c"]  # no temporary directory left


def test_training_forward_is_the_inference_models_math(trained_ckpt):
    model = load_model(trained_ckpt, dtype=torch.float32, progress=False)
    cfg = model.config
    params = {n: p for n, p in model.named_parameters() if n != "kv_scales"}
    tok = Tokenizer.from_file(str(trained_ckpt / "tokenizer.json"))
    ids = tok.encode(tt.stdlib_files()[1][0].read_text(encoding="utf-8")).ids[: tt.SEQ_LEN]
    page_size, pages = 16, list(range(tt.SEQ_LEN // 16))
    kv = allocate_kv_cache(cfg, len(pages), page_size, torch.float32)
    with torch.no_grad():
        logits, hidden = model(*build_step_batch([SeqChunk(ids, 0, pages, "all")], page_size).model_args(kv))
        mtp = build_step_batch([SeqChunk(ids[1:], 0, pages, "all")], page_size)
        mtp_logits, mtp_hidden = model.mtp_forward(
            mtp.input_ids,
            mtp.positions,
            hidden[:-1],
            kv,
            mtp.page_table,
            mtp.seq_lens,
            mtp.query_start_loc,
            mtp.slot_mapping,
            mtp.logits_indices,
        )
        ref_logits, ref_hidden = tt.train_forward(params, cfg, torch.tensor([ids]))
        ref_mtp_logits, ref_mtp_hidden = tt.train_mtp_forward(
            params, cfg, torch.tensor([ids[1:]]), ref_hidden[:, :-1]
        )
    torch.testing.assert_close(ref_logits[0], logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ref_hidden[0], hidden, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ref_mtp_logits[0], mtp_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ref_mtp_hidden[0], mtp_hidden, atol=1e-4, rtol=1e-4)
    assert logits.std() > 1.0  # trained logits, not the near-constant ones of a fresh init


def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    assert tt.main(["--out", str(tmp_path / "x"), "--steps", "0", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: steps must be at least 1, got 0"
    (tmp_path / "taken").mkdir()
    assert tt.main(["--out", str(tmp_path / "taken"), "--steps", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "already exists" in err
    with pytest.raises(tt.TrainError, match="found 0 .py files"):
        tt.stdlib_files(tmp_path)

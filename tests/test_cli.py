import torch

import hy3c
from hy3c.checkpoint.loader import load_model
from hy3c.checkpoint.reference import model_logits
from hy3c.checkpoint.tokenizer import Hy3Tokenizer
from hy3c.cli import main


def test_init_checkpoint_then_generate(tmp_path, capsys):
    out = tmp_path / "ckpt"
    assert main(["init-checkpoint", "--preset", "tiny", "--seed", "1", "--out", str(out)]) == 0
    for name in (
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "chat_template.jinja",
    ):
        assert (out / name).is_file()
    capsys.readouterr()
    greedy = ["--prompt", "Hello", "--max-tokens", "5", "--temperature", "0", "--show-ids"]
    assert main(["generate", "--model", str(out), *greedy]) == 0
    stdout = capsys.readouterr().out
    assert stdout.endswith("\n")
    text, ids = stdout[:-1].rsplit("\n", 1)  # the generated text may itself hold newlines
    tok = Hy3Tokenizer.from_dir(out)
    assert 1 <= len(ids.split()) <= 5 and tok.decode([int(i) for i in ids.split()]) == text
    assert (
        main(
            [
                "generate",
                "--model",
                str(out),
                "--prompt",
                "Hi",
                "--chat",
                "--temperature",
                "0.8",
                "--seed",
                "3",
            ]
        )
        == 0
    )


def test_chat_template_renders_the_hy3_format(tiny_ckpt):
    tok = Hy3Tokenizer.from_dir(tiny_ckpt)
    text = tok.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
        ]
    )
    assert text == (
        "<｜hy_begin_of_sentence:opensource｜>Be brief.<｜reasoning_mode:opensource｜>reasoning_effort:no_think"
        "<｜hy_User:opensource｜>Hi<｜hy_Assistant:opensource｜><think:opensource></think:opensource>Hello"
        "<｜hy_eos:opensource｜><｜hy_User:opensource｜>Bye<｜hy_Assistant:opensource｜>"
        "<think:opensource></think:opensource>"
    )
    ids = tok.encode(text)
    assert ids[0] == 0 and tok.decode(ids, skip_special_tokens=False) == text


def test_fp8_init_checkpoint(tmp_path):
    out = tmp_path / "fp8"
    assert main(["init-checkpoint", "--out", str(out), "--fp8", "dynamic"]) == 0
    model = load_model(out, progress=False)
    assert model.layers[0].mlp.gate_up_proj.is_fp8 and model.layers[0].mlp.gate_up_proj.input_scale is None


def test_bad_input_exits_with_a_message(tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "error:" in capsys.readouterr().err
    out = tmp_path / "c"
    assert main(["init-checkpoint", "--out", str(out)]) == 0
    assert main(["init-checkpoint", "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["init-checkpoint", "--out", str(tmp_path / "d"), "--preset", "huge"]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_reference_logits_public_function(tiny_ckpt):
    ids = torch.randint(0, 512, (2, 9))
    out = hy3c.reference_logits(tiny_ckpt, ids)
    assert out.shape == (2, 9, 512) and out.dtype == torch.float32
    torch.testing.assert_close(
        out, model_logits(load_model(tiny_ckpt, dtype=torch.float32, progress=False), ids)
    )
    assert hy3c.reference_logits(tiny_ckpt, ids[0]).shape == (1, 9, 512)
    try:
        hy3c.reference_logits(tiny_ckpt, torch.tensor([[600]]))
    except ValueError as exc:
        assert "input_ids must lie in" in str(exc)
    else:
        raise AssertionError("out-of-vocabulary ids must be rejected")


def test_random_model_equals_the_written_checkpoint(tiny_ckpt):
    from hy3c.checkpoint.random_checkpoint import random_model
    from hy3c.config import Hy3Config

    config = Hy3Config.from_dir(tiny_ckpt)
    built = random_model(config, torch.bfloat16, seed=0).state_dict()
    loaded = load_model(tiny_ckpt, dtype=torch.bfloat16, progress=False).state_dict()
    assert all(torch.equal(built[k], loaded[k]) for k in loaded)


def test_checkpoint_options_and_outputs_that_would_delete_the_input(tiny_ckpt, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    tensors = load_file(ckpt / "model.safetensors")
    mtp = [k for k in tensors if k.startswith("model.layers.3.")]
    for key in mtp:
        tensors.pop(key)
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(ckpt / "model.safetensors"))
    compile_args = ["compile", "--model", str(ckpt), "--recipe", "cpu-reference", "--out"]
    assert main([*compile_args, str(tmp_path / "a")]) == 2
    err = capsys.readouterr().err
    assert "model.extra.weight" in err and "missing" in err
    ok = [*compile_args, str(tmp_path / "a"), "--no-mtp", "--ignore-unexpected", "model.extra.*"]
    assert main(ok) == 0
    gen = ["generate", "--model", str(ckpt), "--prompt", "x", "--max-tokens", "2", "--no-mtp"]
    assert main([*gen, "--ignore-unexpected", "model.extra.*"]) == 0
    capsys.readouterr()
    for out in (ckpt, tmp_path):  # the checkpoint itself, or a directory holding it
        assert main([*compile_args, str(out), "--overwrite", "--no-mtp", "--ignore-unexpected", "*"]) == 2
        assert "would delete the input" in capsys.readouterr().err
    assert (ckpt / "model.safetensors").is_file()
    assert main(["convert-fp8", "--model", str(ckpt), "--out", str(tmp_path / "a"), "--no-mtp"]) == 2
    assert "already exists" in capsys.readouterr().err
    fp8_transformers = ["init-checkpoint", "--out", str(tmp_path / "t"), "--fp8", "static"]
    assert main([*fp8_transformers, "--scheme", "transformers"]) == 2
    assert "hub naming" in capsys.readouterr().err


def test_user_mistakes_get_one_line_errors(tiny_ckpt, tmp_path, capsys):
    from hy3c.serve.http.demo import free_port

    def fails_with(argv, message):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err, err

    port = free_port()  # nothing listens there
    fails_with(
        ["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1"], "/v1/models"
    )
    preset = tmp_path / "preset"
    assert main(["compile", "--preset", "tiny", "--recipe", "cpu-reference", "--out", str(preset)]) == 0
    fails_with(["generate", "--artifact", str(preset), "--prompt", "x"], "can be inspected, not run")
    fp8 = tmp_path / "fp8"
    assert main(["init-checkpoint", "--out", str(fp8), "--fp8", "dynamic"]) == 0
    fails_with(["convert-fp8", "--model", str(fp8), "--out", str(tmp_path / "again")], "already an FP8")
    modelopt_dynamic = ["convert-fp8", "--model", str(tiny_ckpt), "--out", str(tmp_path / "mo")]
    fails_with([*modelopt_dynamic, "--layout", "modelopt", "--activation", "dynamic"], "static activation")
    if not torch.cuda.is_available():
        fails_with(
            ["generate", "--model", str(tiny_ckpt), "--prompt", "x", "--device", "cuda"], "CUDA is not"
        )


def test_python_dash_m_hy3c_passes_the_exit_status_on(tmp_path):
    import subprocess
    import sys

    absent, out = str(tmp_path / "absent"), str(tmp_path / "art")
    command = [
        sys.executable,
        "-m",
        "hy3c",
        "compile",
        "--model",
        absent,
        "--recipe",
        "h200-bf16",
        "--out",
        out,
    ]
    run = subprocess.run(command, capture_output=True, text=True)
    assert run.returncode != 0 and "absent" in run.stderr
    assert subprocess.run([sys.executable, "-m", "hy3c", "--help"], capture_output=True).returncode == 0


def test_generate_from_an_artifact_equals_the_eager_model(tiny_ckpt, tmp_path, capsys):
    """`hy3c compile` then `hy3c generate --artifact` (the program without Inductor, the default) prints
    the same greedy ids as `hy3c generate --model` (both through the serving engine)."""
    art = tmp_path / "art"
    assert main(["compile", "--model", str(tiny_ckpt), "--recipe", "cpu-reference", "--out", str(art)]) == 0
    outputs = []
    for source in (["--artifact", str(art)], ["--model", str(tiny_ckpt), "--dtype", "float32"]):
        capsys.readouterr()
        greedy = ["--prompt", "Hello", "--max-tokens", "6", "--temperature", "0", "--show-ids"]
        assert main(["generate", *source, *greedy]) == 0
        outputs.append(capsys.readouterr().out.rstrip("\n").rsplit("\n", 1)[1])
    assert outputs[0] == outputs[1] and len(outputs[0].split()) >= 1

"""CLI: JSON output, help texts, and user errors (clear message, exit != 0, no traceback)."""
import json
import shutil
import subprocess
import sys

import pytest

from moetier.cli import build_parser, commands, main


def cli(*argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_run_json_prints_one_object(tiny_model_dir, capsys):
    code, out, err = cli("run", tiny_model_dir, "--prompt", "The quick", "-n", "5", "--seed", "1", "--json",
                         "--device", "cpu", capsys=capsys)
    assert code == 0
    obj = json.loads(out)
    assert set(obj) >= {"text", "token_ids", "prompt_token_ids", "finish_reason", "stats"}
    assert set(obj["stats"]) >= {"prompt_tokens", "generated_tokens", "prefill_tok_s", "decode_tok_s", "ttft_s"}
    assert obj["stats"]["generated_tokens"] == len(obj["token_ids"]) <= 5


def test_run_prompt_ids_and_chat(tiny_model_dir, capsys):
    code, out, _ = cli("run", tiny_model_dir, "--prompt-ids", "5,6,7", "-n", "3", "--temperature", "0", "--json",
                       capsys=capsys)
    assert code == 0 and json.loads(out)["prompt_token_ids"] == [5, 6, 7]
    code, out, _ = cli("run", tiny_model_dir, "--chat", "--prompt", "hello", "-n", "3", "--json", capsys=capsys)
    assert code == 0 and json.loads(out)["prompt_token_ids"]


def test_every_command_has_help(capsys):
    parser = build_parser()
    for name in commands():
        with pytest.raises(SystemExit) as e:
            parser.parse_args([name, "--help"])
        assert e.value.code == 0
        assert "usage: moetier " + name in capsys.readouterr().out


def corrupt(tmp_path, tiny_model_dir, how):
    d = tmp_path / how
    shutil.copytree(tiny_model_dir, d)
    st = d / "model.safetensors"
    if how == "truncated":
        data = st.read_bytes()
        st.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        st.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    elif how == "no_config":
        (d / "config.json").unlink()
    elif how == "no_weights":
        st.unlink()
    elif how == "bad_type":
        cfg = json.loads((d / "config.json").read_text())
        cfg["model_type"] = "llama_moe_9000"
        (d / "config.json").write_text(json.dumps(cfg))
    elif how == "bad_shape":
        cfg = json.loads((d / "config.json").read_text())
        cfg["hidden_size"] = 72
        (d / "config.json").write_text(json.dumps(cfg))
    elif how == "bad_json":
        (d / "config.json").write_text("{oops")
    return d


@pytest.mark.parametrize("how,message", [
    ("truncated", "truncated"), ("garbage", "not valid JSON"), ("no_config", "config.json: missing"),
    ("no_weights", "no *.safetensors"), ("bad_type", "unsupported model_type 'llama_moe_9000'"),
    ("bad_shape", "has shape"), ("bad_json", "not valid JSON"),
])
def test_bad_checkpoints_give_clear_errors(tmp_path, tiny_model_dir, capsys, how, message):
    d = corrupt(tmp_path, tiny_model_dir, how)
    code, out, err = cli("run", d, "--prompt", "hi", "-n", "2", capsys=capsys)
    assert code != 0
    assert message in err and str(d) in err, err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv,message", [
    (["--max-tokens", "-1"], "--max-tokens must be >= 0"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["--temperature", "-2"], "temperature must be >= 0"),
    (["--device", "tpu"], "unknown device"),
    (["--dtype", "int3"], "unknown dtype"),
    (["--ctx", "8"], "context holds 8"),
])
def test_bad_arguments_give_clear_errors(tiny_model_dir, capsys, argv, message):
    prompt = [] if "--prompt-ids" in argv else ["--prompt", "The quick brown fox jumps over the lazy dog"]
    code, out, err = cli("run", tiny_model_dir, *prompt, *argv, capsys=capsys)
    assert code != 0 and message in err, err
    assert "Traceback" not in err


def test_missing_model_directory(capsys):
    code, _, err = cli("run", "/nonexistent/model/dir", capsys=capsys)
    assert code != 0 and "no such model directory" in err


def test_subprocess_exit_code_and_no_traceback(tmp_path):
    r = subprocess.run([sys.executable, "-m", "moetier", "run", str(tmp_path / "nope"), "-n", "-1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "moetier: error" in r.stderr

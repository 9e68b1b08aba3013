"""`moetier chat` (multi-turn over stdin, reusing the cache) and `moetier verify` (vs transformers)."""
import io
import json
import sys

from moetier.cli import main


def test_chat_multi_turn_reuses_the_cache(tiny_model_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n/stats\nTell me more\n/stats\n/exit\n"))
    code = main(["chat", str(tiny_model_dir), "-n", "6", "--temperature", "0", "--device", "cpu"])
    out, err = capsys.readouterr()
    assert code == 0
    stats = _json_blocks(err)
    assert len(stats) == 2
    assert stats[0]["cached_tokens"] == 0
    # the second turn reuses the first turn's prompt and reply
    assert stats[1]["cached_tokens"] >= stats[0]["prompt_tokens"]
    assert stats[1]["prompt_tokens"] > stats[0]["prompt_tokens"] + stats[0]["generated_tokens"] - 1


def _json_blocks(text):
    blocks, depth, start = [], 0, None
    for i, ch in enumerate(text):
        if ch == "{":
            depth += 1
            start = i if depth == 1 else start
        elif ch == "}":
            depth -= 1
            if depth == 0:
                blocks.append(json.loads(text[start:i + 1]))
    return blocks


def test_verify_reports_agreement(tiny_model_dir, capsys):
    code = main(["verify", str(tiny_model_dir), "--prompt", "The quick brown fox", "--greedy", "8", "--json",
                 "--device", "cpu"])
    out, _ = capsys.readouterr()
    assert code == 0
    r = json.loads(out)
    assert r["top1_agreement"] == 1.0 and r["kl_max"] < 1e-8 and r["greedy_agreement"] == 8
    assert r["max_abs_logit_diff"] < 1e-4

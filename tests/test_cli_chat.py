"""`pagedserve chat`: the streaming REPL, run as a user runs it (stdin piped), against LLM.chat."""
from __future__ import annotations

import os
import subprocess
import sys

from pagedserve import LLM, SamplingParams

THREADS = os.environ.get("PAGEDSERVE_TEST_THREADS")


def _chat(model_dir, stdin: str, *extra, timeout=300):
    cmd = [sys.executable, "-m", "pagedserve", "chat", "--model", str(model_dir), "--max-tokens", "8",
           "--num-gpu-blocks-override", "256", *extra]
    if THREADS:
        cmd += ["--num-threads", THREADS]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))


def _llm_replies(llm, turns: list[str], system: str | None = None, max_tokens: int = 8) -> list[str]:
    msgs = [{"role": "system", "content": system}] if system else []
    replies = []
    for turn in turns:
        msgs.append({"role": "user", "content": turn})
        out = llm.chat(msgs, SamplingParams(max_tokens=max_tokens, temperature=0))[0]
        replies.append(out.outputs[0].text)
        msgs.append({"role": "assistant", "content": out.outputs[0].text})
    return replies


def test_chat_two_turns_match_llm_chat(llama_dir):
    turns = ["Hello there", "What is the capital of France?"]
    r = _chat(llama_dir, "\n".join(turns) + "\n/exit\nnot read\n", "--temperature", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    llm = LLM(model=str(llama_dir), num_gpu_blocks_override=256, num_threads=int(THREADS) if THREADS else None)
    want = _llm_replies(llm, turns)
    assert all(want)  # the tiny model says something (8 tokens, or up to its EOS)
    # piped stdin: no prompt, no banner; stdout is exactly the two streamed replies, one newline after each
    assert r.stdout == want[0] + "\n" + want[1] + "\n"

    # /reset forgets the first turn; --system goes in front; end of input (no /exit) quits too
    r = _chat(llama_dir, "Hello there\n/reset\n\nWhat is the capital of France?\n", "--system", "Be brief.")
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == "\n".join(_llm_replies(llm, ["Hello there"], "Be brief.")
                                 + _llm_replies(llm, ["What is the capital of France?"], "Be brief.")) + "\n"
    assert "cleared" in r.stderr


def test_chat_bad_flag_is_one_line(llama_dir):
    r = _chat(llama_dir, "hi\n", "--block-size", "24")
    assert r.returncode == 2 and "--block-size" in r.stderr and "Traceback" not in r.stderr

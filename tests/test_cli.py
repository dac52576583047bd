"""The command line, as a user runs it."""
import json
import os
import subprocess
import sys

from hf_reference import hf_greedy


def _run(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "pagedserve", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_generate_prints_the_greedy_completion(llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    r = _run("generate", "--model", str(llama_dir), "--prompt", "Once upon a time", "--max-tokens", "12",
             "--ignore-eos", "--num-gpu-blocks-override", "128")
    assert r.returncode == 0, r.stderr
    ref = hf_greedy(str(llama_dir), tuple(tok.encode("Once upon a time")), 12)
    assert r.stdout == tok.decode(ref, skip_special_tokens=True) + "\n"


def test_generate_bad_input_is_one_line(llama_dir):
    r = _run("generate", "--model", str(llama_dir), "--prompt", "hi", "--max-tokens", "0", "--num-gpu-blocks-override", "128")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "max_tokens" in r.stderr
    r = _run("generate", "--model", str(llama_dir), "--prompt", "hi", "--block-size", "24")
    assert r.returncode == 2 and "--block-size" in r.stderr and "Traceback" not in r.stderr
    r = _run("generate", "--model", str(llama_dir), "--prompt", "hi", "--quantization", "bogus")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "quantization='bogus' is not supported" in r.stderr


def test_bench_throughput_reports_figures(tmp_path):
    out = tmp_path / "r.json"
    r = _run("bench", "throughput", "--model", "small", "--workload", "W2", "--num-prompts", "3",
             "--output-json", str(out), "--profile", "--kv-cache-space", "1", env={"PAGEDSERVE_CACHE": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["requests"] == 3 and res["output_tokens"] > 0
    assert res["pagedserve"]["output_tokens_per_s"] > 0 and res["pagedserve"]["seconds_median"] > 0
    assert "engine overhead" in r.stdout and "out tok/s" in r.stdout
    assert res["profile"]["steps"] > 0 and res["profile"]["seconds"]["logits"] > 0
    # the ceiling is measured in the same process, on the model's own GEMM shapes
    assert res["gemm_ceiling_gflops"] > 0 and "GEMM ceiling" in r.stdout
    assert res["ceiling_fraction"] == res["pagedserve"]["achieved_gflops"] / res["gemm_ceiling_gflops"]
    # torch's own GEMMs alone (issue #8's definition) never beat the best of all paths
    assert 0 < res["torch_gemm_ceiling_gflops"] <= res["gemm_ceiling_gflops"]
    assert res["torch_ceiling_fraction"] >= res["ceiling_fraction"]


def test_help_for_every_command():
    for cmd in (["--help"], ["generate", "--help"], ["bench", "throughput", "--help"], ["bench", "serve", "--help"],
                ["plan", "--help"]):
        r = _run(*cmd)
        assert r.returncode == 0 and "usage" in r.stdout.lower(), (cmd, r.stderr)


def test_openmp_threads_spin_briefly_unless_the_user_says_otherwise():
    """The `pagedserve` command sets a short OpenMP spin before torch loads; importing the package
    as a library leaves the environment alone."""
    code = ("import os, sys, pagedserve; from pagedserve import cli; before = os.environ.get('GOMP_SPINCOUNT'); "
            "sys.stdout = sys.stderr; cli.main([]); sys.stdout = sys.__stdout__; "
            "print(before, os.environ.get('GOMP_SPINCOUNT'), os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.stdout.split() == ["None", "2000", "None"], r.stderr
    for user in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "50"}):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, **user})
        spin = user.get("GOMP_SPINCOUNT", "None")
        assert r.stdout.split() == [spin, spin, user.get("OMP_WAIT_POLICY", "None")], r.stderr


def test_every_command_help_shows_the_defaults():
    """Each option with a default says it in --help, for every sub-command at any depth."""
    import argparse

    from pagedserve.cli import build_parser

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield from walk(child, path + [name])
            elif (action.option_strings and action.nargs != 0
                  and action.default not in (None, False, argparse.SUPPRESS)):
                yield path, action, parser._get_formatter()

    checked = 0
    for path, action, formatter in walk(build_parser(), ["pagedserve"]):
        shown = formatter._get_help_string(action) if action.help else ""
        assert "default" in shown.lower(), (" ".join(path), action.option_strings)
        checked += 1
    assert checked > 30
    gen = build_parser(only="generate")
    help_text = " ".join(gen._subparsers._group_actions[0].choices["generate"].format_help().split())
    assert "--max-tokens MAX_TOKENS (default: 64)" in help_text

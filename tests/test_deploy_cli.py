"""Every documented bad input to the real `splitspec` CLI ends in one line on stderr and exit status 2."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

# Started in place of a CPU actor when a test puts this folder on PYTHONPATH: it leaves a mark and dies
# the way a broken actor does, so a test sees whether (and how) the CLI started one.
ACTOR_TRAP = """\
import os, sys
if "splitspec.cpu_actor.service" in sys.orig_argv:
    open(os.environ["SPLITSPEC_TEST_ACTOR_MARK"], "w").close()
    sys.stderr.write("Traceback (most recent call last):\\n  File x\\nRuntimeError: no CPUs to pin the shard to\\n")
    os._exit(1)
"""


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "splitspec.deploy.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def _one_line_error(result: subprocess.CompletedProcess, command: str, *expected: str) -> str:
    """The single error line, after checking status 2, no traceback and the expected words."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"splitspec {command}: error: "), lines[0]
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def copy_of(converted_small, tmp_path):
    """A private copy of the converted folder, to damage."""
    folder = tmp_path / "converted"
    shutil.copytree(converted_small, folder)
    return folder


@pytest.fixture
def actor_trap(tmp_path):
    """(env that replaces any CPU actor with a failing one, the file it marks when one is started)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(ACTOR_TRAP)
    mark = tmp_path / "actor-started"
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "SPLITSPEC_TEST_ACTOR_MARK": str(mark)}, mark


def test_missing_converted_folder(tmp_path):
    result = _cli("generate", "hi", "--converted", str(tmp_path / "nope"))
    _one_line_error(result, "generate", "nope: no such folder", "splitspec convert")


def test_a_folder_that_is_not_converted(tmp_path):
    result = _cli("generate", "hi", "--converted", str(tmp_path))
    _one_line_error(result, "generate", "manifest.json: missing", "splitspec convert")


def test_truncated_converted_folder(copy_of):
    residual = copy_of / "residual8.safetensors"
    residual.write_bytes(residual.read_bytes()[:1000])
    _one_line_error(
        _cli("generate", "hi", "--converted", str(copy_of)), "generate", "residual8.safetensors", "truncated"
    )
    _one_line_error(_cli("inspect", str(copy_of)), "inspect", "residual8.safetensors", "re-convert")


def test_corrupt_manifest(copy_of):
    (copy_of / "manifest.json").write_text('{"format": "splitspec", ')
    _one_line_error(_cli("generate", "hi", "--converted", str(copy_of)), "generate", "manifest.json: not valid JSON")


def test_inspect_reports_the_folder_and_catches_a_flipped_byte(copy_of):
    result = _cli("inspect", str(copy_of))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for text in ("llama, 2 layers, hidden 576", "kronecker", "residual 6-bit", "residual 8-bit", "format ", "5 files"):
        assert text in out, out
    manifest = json.loads((copy_of / "manifest.json").read_text())
    assert manifest["conversion_id"] in out
    assert re.search(r"residual 6-bit .* 6\.\d{3} bits a weight, 2 groups wider: 1\.qkv r7, 0\.down r8", out), out
    assert re.search(r"residual 8-bit .* 8\.\d{3} bits a weight\n", out), out
    assert f"{manifest['files']['base.safetensors']['bytes']:,} bytes" in out
    assert f"up to 8,192 tokens (--ctx-size); K/V {2 * 2 * 3 * 64 * 4:,} bytes a token in float32" in out  # 2 layers
    assert re.search(r"draft stats +version 2, 8-bit verifier on 2 chats x 24 tokens: .*; n-gram drafts \d", out), out

    base = copy_of / "base.safetensors"
    data = bytearray(base.read_bytes())
    data[-1] ^= 0xFF  # same size, same header: only the checksum can tell
    base.write_bytes(bytes(data))
    _one_line_error(_cli("inspect", str(copy_of)), "inspect", "base.safetensors", "sha256 differs")
    assert _cli("inspect", str(copy_of), "--no-verify").returncode == 0


def test_a_width_the_folder_lacks_is_refused_before_any_actor_starts(copy_of, actor_trap):
    manifest = json.loads((copy_of / "manifest.json").read_text())
    del manifest["residuals"]["7"], manifest["files"]["residual7.safetensors"]
    (copy_of / "manifest.json").write_text(json.dumps(manifest))
    (copy_of / "residual7.safetensors").unlink()
    env, mark = actor_trap
    result = _cli("generate", "hi", "--converted", str(copy_of), "--bits", "7", env=env)
    _one_line_error(result, "generate", "no 7-bit residual, only 6, 8-bit", "--bits 8")
    assert not mark.exists()


def test_a_folder_without_tree_statistics_is_refused_for_trees_before_any_actor_starts(copy_of, actor_trap):
    (copy_of / "tree_stats.json").unlink()
    env, mark = actor_trap
    result = _cli("generate", "hi", "--converted", str(copy_of), "--draft", "tree", env=env)
    _one_line_error(result, "generate", "no tree statistics", "splitspec fit-tree", "--draft chain")
    assert not mark.exists()
    _one_line_error(_cli("fit-tree", str(copy_of / "nope")), "fit-tree", "no such folder")
    result = _cli("generate", "hi", "--converted", str(copy_of), "--draft-max", "99", env=env)
    _one_line_error(result, "generate", "draft_max = 99 nodes", "max_tokens")


def test_tree_statistics_from_before_the_ngram_replay_still_serve_with_a_hint(copy_of, actor_trap):
    stats = json.loads((copy_of / "tree_stats.json").read_text())
    old = {k: v for k, v in stats.items() if k not in ("version", "ngram")}
    (copy_of / "tree_stats.json").write_text(json.dumps(old))
    out = _cli("inspect", str(copy_of), "--no-verify").stdout
    assert "draft stats     version 1" in out and "no n-gram replay" in out and "splitspec fit-tree" in out, out
    env, mark = actor_trap  # the hint comes before any actor starts; the trap then ends the run
    result = _cli("generate", "hi", "--converted", str(copy_of), env=env)
    assert "predate n-gram drafts" in result.stderr and f"splitspec fit-tree {copy_of}" in result.stderr
    assert mark.exists(), result.stderr  # the old statistics loaded, and the run went on to start an actor
    (copy_of / "tree_stats.json").unlink()
    assert "draft stats     none: run `splitspec fit-tree" in _cli("inspect", str(copy_of), "--no-verify").stdout


def test_a_cpu_actor_that_cannot_start(converted_small, actor_trap):
    env, mark = actor_trap
    result = _cli("generate", "hi", "--converted", str(converted_small), "--max-new-tokens", "2", env=env)
    _one_line_error(result, "generate", "CPU actor 0/1", "exited with code 1", "RuntimeError: no CPUs to pin")
    assert mark.exists()


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("generate", "hi", "--bits", "5"), "argument --bits: '5' is not a residual width: choose 6, 7 or 8"),
        (("generate", "hi", "--bits", "x"), "argument --bits: 'x' is not a residual width"),
        (("convert", "default", "out", "--residual-bits", "6,x"), "--residual-bits: 'x' is not a residual width"),
        (("convert", "default", "out", "--residual-bits", "5"), "--residual-bits: '5' is not a residual width"),
        (("generate", "hi", "--device", "gpu"), "argument --device: 'gpu' is not a device: use cpu, cuda or cuda:N"),
        (("generate", "hi", "--cpu-actors", "0"), "argument --cpu-actors: 0 must be at least 1"),
        (("generate", "hi", "--draft", "big"), "argument --draft: invalid choice: 'big'"),
        (("generate", "hi", "--resident-gb", "-1"), "argument --resident-gb: must be >= 0, got '-1'"),
        (("serve", "--converted", "x", "--stop-timeout", "0"), "argument --stop-timeout: must be > 0, got '0'"),
        (("generate", "hi", "--engine-cpus", "1-a"), "argument --engine-cpus: '1-a' is not a CPU list"),
    ],
)
def test_bad_flags(args, expected):
    _one_line_error(_cli(*args), args[0], expected, "--help")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "--residual-widths: cannot read the width map"),
        ("{oops", "is not JSON"),
        ('{"9.qkv": "wide"}', 'must map "layer.group" to a width'),
        ('{"9.qkv": 5}', "ResidualConfig.widths maps 'layer.group' (e.g. '9.qkv') to 7 or 8, got '9.qkv': 5"),
        ('{"allocation": {"widths": {"qkv": 7}}}', "got 'qkv': 7"),
    ],
)
def test_bad_width_map(tmp_path, content, expected):
    """A width map that cannot be read or names no group's width is refused before any conversion starts."""
    path = tmp_path / "widths.json"
    if content is not None:
        path.write_text(content)
    result = _cli("convert", "default", str(tmp_path / "out"), "--residual-widths", str(path))
    _one_line_error(result, "convert", expected)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_cuda_device_that_is_not_there(converted_small):
    result = _cli("generate", "hi", "--converted", str(converted_small), "--device", "cuda:0")
    _one_line_error(result, "generate", "--device cuda:0", "no usable CUDA device", "--device cpu")


@pytest.mark.parametrize("command", [("generate", "hi"), ("serve",)])
def test_cuda_graphs_on_the_cpu(converted_small, command):
    result = _cli(*command, "--converted", str(converted_small), "--cuda-graphs")
    _one_line_error(result, command[0], "cuda_graphs records CUDA graphs: it needs device cuda, not 'cpu'")


def test_bad_sampling_flags_are_refused_before_any_actor_starts(converted_small, actor_trap):
    env, mark = actor_trap
    for flag, value, expected in (
        ("--repetition-penalty", "0", "repetition_penalty must be in (0, 10.0] (1: off), got 0.0"),
        ("--frequency-penalty", "3", "frequency_penalty must be in [-2, 2] (0: off), got 3.0"),
        ("--min-p", "-0.1", "min_p must be in [0, 1], got -0.1"),
    ):
        result = _cli("generate", "hi", "--converted", str(converted_small), flag, value, env=env)
        _one_line_error(result, "generate", expected)
    assert not mark.exists()


@pytest.mark.parametrize("command", [("generate", "hi"), ("serve",)])
def test_a_context_past_the_model_s_positions_is_refused_before_any_actor_starts(converted_small, actor_trap, command):
    env, mark = actor_trap
    result = _cli(*command, "--converted", str(converted_small), "--ctx-size", "9000", env=env)
    _one_line_error(result, command[0], "a context of 9000 tokens", "exceeds the 8192 positions", "lower it")
    assert not mark.exists()


@pytest.mark.parametrize("command", [("generate", "hi"), ("serve",)])
def test_engine_cpus_this_process_may_not_use_are_refused_before_any_actor_starts(converted_small, actor_trap, command):
    env, mark = actor_trap
    from splitspec.numa import cpulist

    far = max(os.sched_getaffinity(0)) + 1
    result = _cli(*command, "--converted", str(converted_small), "--engine-cpus", f"0,{far}", env=env)
    named = cpulist([0, far])  # "0-1" where this process may use CPU 0 alone (a test before it pinned it)
    _one_line_error(result, command[0], f"the engine's CPUs {named} are not all among the CPUs this process may use")
    assert not mark.exists()


@pytest.mark.parametrize("command", [("generate", "hi"), ("serve",), ("plan",)])
def test_a_k_v_element_it_lacks_is_refused(converted_small, command):
    result = _cli(*command, "--converted", str(converted_small), "--kv-dtype", "int4")
    _one_line_error(result, command[0], "--kv-dtype", "invalid choice: 'int4'", "bfloat16")


def test_a_prompt_longer_than_the_context_is_refused_before_any_actor_starts(converted_small, actor_trap):
    env, mark = actor_trap
    result = _cli("generate", "hi " * 64, "--converted", str(converted_small), "--ctx-size", "40", env=env)
    _one_line_error(result, "generate", "exceed the context of 40 tokens", "--ctx-size")
    assert not mark.exists()


def test_generate_follows_a_json_schema_and_refuses_a_bad_one(converted_small, tmp_path, actor_trap):
    schema = tmp_path / "flag.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}))
    args = ("generate", "Is water wet?", "--converted", str(converted_small), "--no-ray", "--max-new-tokens", "24")
    result = _cli(*args, "--json-schema", str(schema), "--draft", "chain", "--draft-max", "4")
    assert result.returncode == 0, result.stderr[-2000:]
    assert isinstance(json.loads(result.stdout.strip())["ok"], bool), result.stdout
    env, mark = actor_trap
    for content, expected in (("{oops", "not a readable JSON file"), ('{"type": 5}', "json_schema: ")):
        schema.write_text(content)
        result = _cli("generate", "hi", "--converted", str(converted_small), "--json-schema", str(schema), env=env)
        _one_line_error(result, "generate", f"--json-schema {schema}: ", expected)
    grammar = tmp_path / "answer.gbnf"
    grammar.write_text('root ::= ("yes" | "no"')
    base = ("generate", "hi", "--converted", str(converted_small), "--grammar-file", str(grammar))
    _one_line_error(_cli(*base, env=env), "generate", f"--grammar-file {grammar}: grammar: ")
    both = _cli(*base, "--json-schema", str(schema), env=env)
    _one_line_error(both, "generate", "argument --json-schema: not allowed with argument --grammar-file")
    assert not mark.exists()


@pytest.mark.parametrize("command", [("generate", "hi"), ("serve",)])
def test_bad_ngram_bounds(converted_small, command):
    """Both commands take the draft's flags, and refuse n-gram bounds that cannot hold before anything starts."""
    result = _cli(*command, "--converted", str(converted_small), "--draft", "ngram", "--ngram-min", "5")
    _one_line_error(result, command[0], "SpecConfig needs 1 <= ngram_min <= ngram_max, got ngram_min=5")


def test_unknown_model_path(tmp_path):
    result = _cli("generate", "hi", "--model", str(tmp_path / "nope"))
    _one_line_error(result, "generate", "no such model file or folder", ".gguf")


def _unsupported_folder(folder: Path, model_type: str) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    config = {"model_type": model_type, "n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 16}
    (folder / "config.json").write_text(json.dumps({**config, "bos_token_id": 0, "eos_token_id": 0}))
    save_file({"wte.weight": torch.zeros(16, 8)}, folder / "model.safetensors")
    return folder


def test_unsupported_architecture(tmp_path):
    folder = _unsupported_folder(tmp_path / "gpt2", "gpt2")
    result = _cli("generate", "hi", "--model", str(folder))
    _one_line_error(result, "generate", "architecture 'gpt2' is not supported", "supports llama")
    unknown = _unsupported_folder(tmp_path / "foo", "nosuchmodel")
    result = _cli("convert", str(unknown), str(tmp_path / "out"))
    _one_line_error(result, "convert", "config.json: transformers cannot read it", "supports llama")
    assert not (tmp_path / "out").exists()


def test_debug_shows_the_traceback(tmp_path):
    result = _cli("generate", "hi", "--converted", str(tmp_path / "nope"), "--debug")
    assert result.returncode != 0 and "Traceback" in result.stderr and "CliError" in result.stderr


def test_a_config_file_sets_defaults_that_the_command_line_overrides(tmp_path):
    """Precedence: built-in defaults < the file's [command] table < the flags given."""
    from splitspec.config import BatchConfig
    from splitspec.deploy.cli import build_parser
    from splitspec.deploy.config_file import parse_with_config

    conf = tmp_path / "splitspec.toml"
    conf.write_text(
        '[serve]\nmax_batch = 4\nport = 8100\nmodel-alias = "local"\nprefill-per-round = 512\n'
        "[generate]\nmax_new_tokens = 7\n"
    )
    base = ["serve", "--converted", "x", "--config", str(conf)]
    args = parse_with_config(build_parser(), base)
    assert (args.max_batch, args.port, args.model_alias) == (4, 8100, "local")
    assert args.max_queue == BatchConfig().max_queue  # not in the file: the built-in default
    assert args.prefill_per_round == 512
    args = parse_with_config(build_parser(), [*base, "--port", "9000"])
    assert (args.max_batch, args.port) == (4, 9000)
    # a required flag may come from the file, and the command line still wins over it
    conf.write_text('[serve]\nconverted = "from-file"\n')
    assert parse_with_config(build_parser(), ["serve", "--config", str(conf)]).converted == "from-file"
    assert parse_with_config(build_parser(), ["serve", "--config", str(conf), "--converted", "y"]).converted == "y"
    conf.write_text("[serve]\nport = 8100\n")
    with pytest.raises(SystemExit):  # neither gives it
        parse_with_config(build_parser(), ["serve", "--config", str(conf)])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[serve]\nmax_batch = 0\n", "[serve] max_batch: 0 must be at least 1"),
        ("[serve]\nbatch_size = 4\n", "has no setting 'batch_size'"),
        ("[serv]\nport = 1\n", "unknown table(s) serv"),
        ("[serve\n", "not valid TOML"),
    ],
)
def test_a_bad_config_file_is_refused_in_one_line(tmp_path, text, expected):
    conf = tmp_path / "bad.toml"
    conf.write_text(text)
    result = _cli("serve", "--converted", str(tmp_path), "--config", str(conf), timeout=120)
    _one_line_error(result, "serve", expected)


def test_serve_refuses_a_port_in_use_before_starting_anything(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")  # the port is checked before the folder is read
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        result = _cli("serve", "--converted", str(tmp_path), "--port", port, timeout=120)
    _one_line_error(result, "serve", f"cannot listen on 127.0.0.1:{port}", "--port")


def test_serve_refuses_row_weights_that_do_not_match_the_actors(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = str(free.getsockname()[1])
    result = _cli("serve", "--converted", str(tmp_path), "--port", port, "--row-weights", "3,1", timeout=120)
    _one_line_error(result, "serve", "row_weights needs 1 positive shares")
    result = _cli("serve", "--converted", str(tmp_path), "--row-weights", "3,-1", timeout=120)
    _one_line_error(result, "serve", "row weights must be positive")


def test_serve_refuses_a_chat_template_it_cannot_read(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    result = _cli("serve", "--converted", str(tmp_path), "--chat-template", str(tmp_path / "none.jinja"), timeout=120)
    _one_line_error(result, "serve", "--chat-template", "cannot read it")


def test_stopping_takes_the_first_signal_and_gives_the_signals_back(capsys):
    """In the block the first SIGTERM is a Ctrl-C and arms the watcher; leaving the block gives the handlers
    and the wakeup fd back and ends the watcher; ``descendants`` finds children and grandchildren. (What
    the watcher does, a second signal or a hung teardown ending the process at once with everything it
    started, is ``test_deploy_serve.test_cli_serves_until_stopped``: it ends the process it runs in.)"""
    import signal
    import threading

    from splitspec.deploy.stopping import Stopping, descendants

    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with pytest.raises(KeyboardInterrupt), Stopping("test", 60):
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the handler runs between bytecodes
            pass
    assert "splitspec test: stopping (Ctrl-C again to stop at once)" in capsys.readouterr().err
    assert {s: signal.getsignal(s) for s in before} == before
    assert signal.set_wakeup_fd(-1) == -1  # the watcher's pipe is gone with it
    assert not [t for t in threading.enumerate() if t.name == "splitspec-stopping"]

    shell = subprocess.Popen(["sh", "-c", "sleep 30 & sleep 30 & wait"])
    try:
        for _ in range(100):  # until both children have become sleeps (a fork shows the shell's cmdline first)
            below = descendants(shell.pid)
            if len(below) == 2 and all(b"sleep" in Path(f"/proc/{pid}/cmdline").read_bytes() for pid in below):
                break
            time.sleep(0.05)
        else:
            raise AssertionError(f"the shell's two sleeps never showed: {below}")
        mine = descendants(os.getpid())
        assert set(below) < set(mine) and mine.index(shell.pid) < min(map(mine.index, below))
    finally:
        for pid in [*descendants(shell.pid), shell.pid]:
            os.kill(pid, signal.SIGKILL)
        shell.wait()


# In a user and mount namespace of its own: a copy of the folder on a tmpfs with 4 KiB to spare, then fit-tree.
FIT_ON_A_FULL_DISK = """\
set -e
disk=$1 folder=$2 seen=$3
mount -t tmpfs -o size=$(( $(du -sk "$folder" | cut -f1) + 1024 ))k tmpfs "$disk"
cp -r "$folder" "$disk/folder"
fallocate -l $(( $(df --output=avail -B1 "$disk" | tail -1) - 4096 )) "$disk/filler"
"$4" -m splitspec.deploy.cli fit-tree "$disk/folder" --prompts 2 --new-tokens 8 2> "$seen/err" || echo $? > "$seen/rc"
ls -A "$disk/folder" > "$seen/ls"
cmp "$folder/tree_stats.json" "$disk/folder/tree_stats.json" && echo same > "$seen/stats"
"""


def test_a_full_disk_ends_any_command_in_one_line(converted_small, tmp_path, own_mounts):
    """``fit-tree`` on a folder whose disk is full: one line naming the file and what to do, exit status 2;
    the folder's statistics stay as they were and no half-written file is left (the converter's own case,
    with what it keeps, is ``test_quantize_stream``'s)."""
    disk, seen = tmp_path / "disk", tmp_path / "seen"
    disk.mkdir()
    seen.mkdir()
    cmd = [*own_mounts, "sh", "-c", FIT_ON_A_FULL_DISK, "sh"]
    run = subprocess.run([*cmd, str(disk), str(converted_small), str(seen), sys.executable], capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert (seen / "rc").read_text().strip() == "2"
    err = (seen / "err").read_text()
    stats = f"{disk}/folder/tree_stats.json"
    expected = f"splitspec fit-tree: error: no space left on the disk of {stats} (No space left on device): free"
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(expected), err
    assert (seen / "stats").read_text().strip() == "same"
    assert not [name for name in (seen / "ls").read_text().split() if name.endswith(".tmp")]

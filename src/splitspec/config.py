"""Every knob of splitspec, in one place.

Each component takes its own dataclass; every field has a default that works on a 2-core laptop
with the default model, and ``__post_init__`` rejects values that would fail later and further away.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitspec.protocol.curve import CurveKeys

# The Hadamard rotation kinds that ``quantize.hadamard`` implements; listed here so that validating a
# config does not import torch.
ROTATIONS = ("sylvester", "kronecker")


SEEDS = (-(2**63), 2**64 - 1)  # the seeds torch.Generator.manual_seed takes


def _cache_root() -> Path:
    return Path(os.environ.get("SPLITSPEC_CACHE", Path.home() / ".cache" / "splitspec"))


ACTIVATION_MODES = ("int16", "int8", "fp32")  # how the CPU kernel multiplies x' (CpuActorConfig.activations)


def check_activations(value: str, name: str = "activations") -> None:
    """The one check of an activation mode, wherever one is taken (configs, kernel, DeviceResidual)."""
    if value not in ACTIVATION_MODES:
        raise ValueError(f"{name} must be one of {ACTIVATION_MODES}, got {value!r}")


@dataclass
class ModelConfig:
    """Which model to load. ``source=None`` means the default SmolLM2-135M-Instruct GGUF."""

    source: str | None = None
    gguf_file: str | None = None
    cache_dir: Path = field(default_factory=lambda: _cache_root() / "models")
    num_layers: int | None = None  # truncate the decoder (tests, quick experiments)

    def __post_init__(self) -> None:
        self.cache_dir = Path(self.cache_dir)
        if self.num_layers is not None and self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1 or None, got {self.num_layers}")


@dataclass
class DataConfig:
    """The fixed ShareGPT split: calibration, tree statistics and evaluation never overlap."""

    seed: int = 20261129
    calib_sequences: int = 28
    calib_seq_len: int = 2048
    tree_conversations: int = 64
    eval_conversations: int = 32
    eval_min_tokens: int = 8000
    eval_max_seq_len: int = 1024
    max_conversations_read: int = 4000  # read only this many conversations from the 125 MB file
    # Calibration takes conversations until their characters reach tokens-needed × this. Real text runs
    # ~3.5–4.5 characters per token, so 6 over-provisions and the split needs no tokenizer.
    calib_chars_per_token: float = 6.0
    # Evaluation conversations held beyond eval_conversations, drawn on (in order) only when the first
    # ones hold fewer than eval_min_tokens scored tokens.
    eval_reserve_conversations: int = 96
    # The dev split (remedies are chosen on it) and the held-out split (chat and code first-turn prompts,
    # each scored on the reference's greedy continuation; never used to choose anything) come after the
    # evaluation part, so adding them left calibration, tree and evaluation as they were.
    dev_conversations: int = 16
    heldout_per_kind: int = 24  # chat prompts and as many code prompts
    heldout_max_prompt_chars: int = 2000  # longer first messages are passed over (they would dominate the run)
    heldout_new_tokens: int = 64

    def __post_init__(self) -> None:
        for name in (
            "calib_sequences",
            "calib_seq_len",
            "tree_conversations",
            "eval_conversations",
            "dev_conversations",
            "heldout_per_kind",
            "heldout_max_prompt_chars",
            "heldout_new_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"DataConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.eval_min_tokens < 0:
            raise ValueError(f"DataConfig.eval_min_tokens must be >= 0, got {self.eval_min_tokens}")
        if self.eval_max_seq_len < 16:
            raise ValueError(f"DataConfig.eval_max_seq_len must be >= 16, got {self.eval_max_seq_len}")
        if self.max_conversations_read < 1:
            raise ValueError(f"DataConfig.max_conversations_read must be >= 1, got {self.max_conversations_read}")
        if self.calib_chars_per_token <= 0:
            raise ValueError(f"DataConfig.calib_chars_per_token must be > 0, got {self.calib_chars_per_token}")
        if self.eval_reserve_conversations < 0:
            raise ValueError(
                f"DataConfig.eval_reserve_conversations must be >= 0, got {self.eval_reserve_conversations}"
            )


@dataclass
class ChannelConfig:
    """Knobs of the GPU↔CPU actor channel (``splitspec.protocol``).

    ``spin_us`` is how long a waiter watches a shared-memory flag before it sleeps on the doorbell pipe
    (the client for its reply, the server for the next request after answering one). A wake-up through
    the pipe costs 15 µs to several hundred on a VM whose idle vCPU halted; a spin yields the core at
    every turn (``sched_yield``), so a peer or thread sharing it still runs. ``own_core_spin_us`` applies
    when the waiter has a core of its own (the engine pins itself and the CPU actors to disjoint CPUs):
    long enough to span the gaps inside a verify pass, so neither side sleeps mid-pass (what the channel
    costs of a pass, spinning and blocking: ``benchmarks/verify_pass.py`` and ``channel.py``, figures in
    ``benchmarks/README.md``). 0 always sleeps at once. ``max_tokens`` and
    ``slots`` size the shared-memory slots (largest tree × in-flight requests), so they bound what one
    request may carry.
    """

    endpoint: str = "tcp://127.0.0.1:5710"
    transport: str = "auto"  # "auto": shared memory when the server is on this host, else tcp
    max_tokens: int = 72  # a 64-node tree's check carries 65 positions
    slots: int = 8  # requests in flight per client: 4 groups x 2 layers
    spin_us: float = 50.0
    own_core_spin_us: float = 2000.0
    connect_timeout_s: float = 10.0
    request_timeout_s: float = 30.0
    heartbeat_ms: int = 1000  # ZeroMQ heartbeat on tcp: a silent peer is dropped after 3 intervals
    max_header_bytes: int = 4096
    # ZeroMQ CURVE keys (``protocol.curve.CurveKeys``): the scheduler makes them per cluster; None is plain
    # (direct-path tests, the benchmark's comparison row). Kept out of repr: it holds secret keys.
    curve: CurveKeys | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"ChannelConfig.endpoint must start with tcp:// or ipc://, got {self.endpoint!r}")
        if self.transport not in ("auto", "shm", "tcp"):
            raise ValueError(f"ChannelConfig.transport must be auto, shm or tcp, got {self.transport!r}")
        for name in ("max_tokens", "slots", "heartbeat_ms"):
            if getattr(self, name) < 1:
                raise ValueError(f"ChannelConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("spin_us", "own_core_spin_us"):
            if not 0 <= getattr(self, name) <= 1e6:
                raise ValueError(f"ChannelConfig.{name} must be in [0, 1e6] microseconds, got {getattr(self, name)}")
        for name in ("connect_timeout_s", "request_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"ChannelConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.max_header_bytes < 256:
            raise ValueError(f"ChannelConfig.max_header_bytes must be >= 256, got {self.max_header_bytes}")


def group_key(layer: int, group: str) -> str:
    """A Linear group's name in a mixed-width map (``ResidualConfig.widths``, the manifest's): ``"9.qkv"``."""
    return f"{layer}.{group}"


def shape_keys(layers: Iterable[Iterable[tuple[str, tuple[int, int]]]]) -> list[list[str]]:
    """Per layer, the key each of its (name, shape) groups goes by between the engine and the CPU actors: the
    name where the group has one shape in every layer; where a layer type changes it (Gemma 4's global
    layers' qkv and o, Qwen 3.5's linear-attention layers), each further shape is a key of its own
    ("qkv#1"), so that a CPU actor's row range of a key is valid at every layer that has it. A converted
    folder (``ConvertedModel.shard_keys``) and a model described in a TOML file (``scheduler.machine``)
    name their groups by this one rule."""
    shapes: dict[str, list[tuple[int, int]]] = {}
    keys = []
    for layer in layers:
        row = []
        for name, shape in layer:
            seen = shapes.setdefault(name, [])
            if shape not in seen:
                seen.append(shape)
            k = seen.index(shape)
            row.append(f"{name}#{k}" if k else name)
        keys.append(row)
    return keys


@dataclass(frozen=True)
class ResidualConfig:
    """How the residual's uniform grid gets its per-(row, 128-group) scales (issue 23).

    ``clip_min`` < 1 searches ``clip_steps`` clip ratios in [clip_min, 1] × max|group| per row and keeps the
    one with the least squared rounding error (an MSE-optimal scale), for the widths in ``clip_bits`` only;
    1 is plain max|group| / qm, as the recipe has it. The widths in ``act_order_bits`` run GPTQ in
    activation order with static group scales (``quantize.gptq.gptq``); the others in natural order.

    ``widths`` maps groups (``"layer.group"``, e.g. ``"9.qkv"``) to the wider width (7 or 8) that the 6-bit
    residual stores them at: mixed widths by sensitivity, within a budget of bits a weight. The map comes
    from ``benchmarks/residual_sensitivity.py`` (the groups whose wider width removes the most KL per byte);
    ``splitspec convert --residual-widths FILE.json`` reads it. The 7- and 8-bit residuals are uniform.
    """

    clip_min: float = 1.0
    clip_steps: int = 16
    clip_bits: tuple[int, ...] = (6,)
    act_order_bits: tuple[int, ...] = ()
    widths: dict[str, int] = field(default_factory=dict)

    def width(self, bits: int, layer: int, group: str) -> int:
        """The width a group is stored at in the ``bits``-bit residual."""
        return self.widths.get(group_key(layer, group), bits) if bits == 6 else bits

    def __post_init__(self) -> None:
        for key, width in self.widths.items():
            layer, _, group = key.partition(".")
            if not (layer.isdigit() and group) or width not in (7, 8):
                raise ValueError(
                    f"ResidualConfig.widths maps 'layer.group' (e.g. '9.qkv') to 7 or 8, got {key!r}: {width!r}"
                )
        if not 0 < self.clip_min <= 1:
            raise ValueError(f"ResidualConfig.clip_min must be in (0, 1], got {self.clip_min}")
        if self.clip_steps < 1:
            raise ValueError(f"ResidualConfig.clip_steps must be >= 1, got {self.clip_steps}")


@dataclass
class ConvertConfig:
    """The offline converter (recipe sections 1–3): rotation kind and seed, GPTQ settings, residual widths.

    ``rotation`` picks the Hadamard transform (``quantize.hadamard``): the full-width ``"kronecker"``
    (Paley ⊗ Sylvester) or the recipe's block-diagonal ``"sylvester"``. Kronecker is the default: on
    widths with a large odd factor (SmolLM2-135M's 576 = 9·64 and 1536 = 3·512) Sylvester is left with
    small blocks, and the converted model measured closer to the reference with Kronecker at every
    residual width (``benchmarks/README.md``, "Precision"). On a power-of-two width the two kinds are the
    same transform.
    """

    residual_bits: tuple[int, ...] = (6, 7, 8)
    rotation: str = "kronecker"
    seed: int = 20261008  # per-Linear seeds are seed + crc32(name) % 100000, as in the recipe
    gptq_block: int = 128
    damp: float = 0.01
    lloyd_iters: int = 60
    lloyd_samples: int = 2_000_000
    # "rtn": round-to-nearest base and residual, no GPTQ: a quick conversion for timing runs, not quality
    quantizer: str = "gptq"
    # read one decoder layer at a time from the source's safetensors (False: the whole float32 model in RAM)
    stream: bool = True
    # A group is quantized this many MiB of float32 rows at a time (rows are independent given the Hessian,
    # so the bytes do not change): a smaller block holds fewer copies of a big group (gate_up) in RAM, but
    # GPTQ factors the group's Hessian once per block, so its blocks hold at least gptq_block_rows_per_input
    # rows per input column: the factoring (d_in³) then stays a small share of the block's work (rows·d_in²),
    # and the block is no bigger than the factoring's own float64 d_in² matrices.
    quantize_block_mib: float = 16.0
    gptq_block_rows_per_input: float = 8.0
    data: DataConfig = field(default_factory=DataConfig)
    residual: ResidualConfig = field(default_factory=ResidualConfig)

    def __post_init__(self) -> None:
        self.residual_bits = tuple(sorted(set(self.residual_bits)))
        bad = [b for b in self.residual_bits if b not in (6, 7, 8)]
        if bad:
            raise ValueError(f"residual bits must be among 6, 7, 8; got {bad}")
        if self.rotation not in ROTATIONS:
            raise ValueError(f"rotation must be one of {', '.join(ROTATIONS)}; got {self.rotation!r}")
        wider = sorted(set(self.residual.widths.values()) - set(self.residual_bits))
        if self.residual.widths and (6 not in self.residual_bits or wider):
            raise ValueError(
                f"residual widths widen groups of the 6-bit residual to widths that are converted too: "
                f"residual_bits {self.residual_bits} lack {[6] if 6 not in self.residual_bits else wider}"
            )
        if self.gptq_block < 1 or (self.gptq_block % 128 and 128 % self.gptq_block):
            raise ValueError(f"gptq_block must nest with the 128-column scale groups, got {self.gptq_block}")
        if not 0 < self.damp < 1:
            raise ValueError(f"damp must be in (0, 1), got {self.damp}")
        if self.lloyd_iters < 1 or self.lloyd_samples < 1000:
            raise ValueError("lloyd_iters must be >= 1 and lloyd_samples >= 1000")
        if self.quantizer not in ("gptq", "rtn"):
            raise ValueError(f"quantizer must be gptq or rtn, got {self.quantizer!r}")
        if not (self.quantize_block_mib > 0 and self.gptq_block_rows_per_input > 0):
            raise ValueError(
                f"quantize_block_mib ({self.quantize_block_mib}) and gptq_block_rows_per_input "
                f"({self.gptq_block_rows_per_input}) must be > 0"
            )


@dataclass
class CpuActorConfig:
    """One CPU actor: which CPUs it runs its residual kernel on, and whether it pins itself there.

    Pinning keeps the kernel's threads on the NUMA node that holds its shard; the memory is then
    first-touched from there, so every page lands on that node.
    """

    threads: int | None = None  # None: one per CPU the actor runs on
    pin: bool = True
    cpus: tuple[int, ...] | None = None  # None: every CPU of numa_node, or of the process if that is None
    numa_node: int | None = None
    # "int16": the kernel rounds x' to int16 per (token, 128-group) and multiplies in integers (faster);
    # "int8": to int8, on the same integer paths; "fp32": as is (quantize/activations.py; their effect on
    # the logits: benchmarks/README.md)
    activations: str = "int16"

    def __post_init__(self) -> None:
        check_activations(self.activations, "CpuActorConfig.activations")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"CpuActorConfig.threads must be >= 1 or None, got {self.threads}")
        if self.cpus is not None:
            self.cpus = tuple(sorted(set(self.cpus)))
            if not self.cpus or self.cpus[0] < 0:
                raise ValueError(f"CpuActorConfig.cpus must be non-empty CPU ids >= 0, got {self.cpus}")
        if self.numa_node is not None and self.numa_node < 0:
            raise ValueError(f"CpuActorConfig.numa_node must be >= 0 or None, got {self.numa_node}")
        if self.cpus is not None and self.numa_node is not None:
            raise ValueError("give CpuActorConfig.cpus or numa_node, not both")


DRAFT_MODES = ("auto", "off", "chain", "tree", "ngram")
VERIFIER_HEADS = ("int16", "fp32", "bf16")
KV_DTYPES = ("float32", "bfloat16", "float16")  # the K/V cache's element (EngineConfig.kv_dtype)
KV_WINDOWS = ("auto", "ring", "full")  # what a sliding layer's K/V keeps (EngineConfig.kv_window)
DRAFT_KV = ("exact", "draft2bit")
CONSTRAINTS = ("json_schema", "grammar", "regex")  # a language a text may be held to (SamplingParams)
MAX_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's top_logprobs limit)
BASE_SHARE = 1 / 6  # the CPU actors' default part of the base on a CPU engine (EngineConfig.base_share)
MAX_LOGIT_BIAS = 100  # OpenAI's range for a logit_bias value
MAX_REPETITION_PENALTY = 10.0  # beyond it a penalty only bans tokens, which logit_bias says plainly


@dataclass
class SpecConfig:
    """Speculative decoding (``gpu_actor.speculative``): what the 2-bit base drafts for each check.

    ``mode``: ``"off"`` is the verifier alone (one token per verify pass); ``"chain"`` drafts ``draft_max``
    tokens in a line (γ); ``"tree"`` a best-first tree of ``draft_max`` nodes from the folder's rank
    statistics (recipe, section 6); ``"auto"`` lets the cost model (``scheduler.cost``) pick the shape with
    the most expected tokens per second from costs the engine measures, from no draft up to ``draft_max``
    nodes and no fewer than ``draft_min`` (0 allows "off"), and where the folder's statistics hold the
    n-gram draft's replay (``splitspec fit-tree``) and ``draft_min`` is 0, the n-gram draft too; ``"ngram"``
    drafts no tokens with the model but copies them from the sequence's own text (``gpu_actor.lookup``):
    what followed the last ``ngram_max`` down to ``ngram_min`` tokens where they last occurred, as many of
    up to ``draft_max`` as the measured verify costs and the acceptance so far say pay. ``p_min`` drops a
    drafted node (and what would hang below it) whose draft probability is under it, as llama.cpp's
    ``--spec-draft-p-min``. ``kv``: ``"exact"`` is the recipe's draft (section 5), reading the verifier's
    K/V of verified positions; ``"draft2bit"`` keeps a second cache of the draft's own K/V for everything,
    for comparison only.
    ``draft_head``: ``"int8"`` gives the draft its own int8 copy of the lm_head on a CPU engine (a quarter
    of the bytes to read per draft step; it only ranks candidates, so the output does not change);
    ``"fp32"`` shares the verifier's. ``min_gain``: under "auto", how much faster (relative) a 2-bit draft
    must be predicted than the verifier alone to be chosen over it; the cost model's predictions are off by
    up to ~10% on a noisy machine (``benchmarks/README.md``), so a smaller gain is as likely a loss (the
    n-gram draft, which proposes only what pays as it goes, needs only be predicted faster).
    ``ngram_branch``: a 2-bit draft's tree also gets the tokens that the n-gram lookup finds, up to
    ``draft_max``, as a branch of their own (merged where the tree holds them already): where the text
    repeats, the check can accept past where the model's draft went wrong. Every found token is verified
    (with ``cuda_graphs``, a power of two of the new nodes), which pays where a few more tokens in a pass
    cost next to nothing (a GPU); the cost model does not weigh it.
    """

    mode: str = "auto"
    draft_max: int = 16
    draft_min: int = 0
    min_gain: float = 0.1
    p_min: float = 0.0
    kv: str = "exact"
    draft_head: str = "int8"
    ngram_max: int = 4
    ngram_min: int = 2
    ngram_branch: bool = False

    def __post_init__(self) -> None:
        if self.mode not in DRAFT_MODES:
            raise ValueError(f"SpecConfig.mode must be one of {', '.join(DRAFT_MODES)}; got {self.mode!r}")
        if self.kv not in DRAFT_KV:
            raise ValueError(f"SpecConfig.kv must be one of {', '.join(DRAFT_KV)}; got {self.kv!r}")
        if not 0 <= self.draft_min <= self.draft_max:
            raise ValueError(
                f"SpecConfig needs 0 <= draft_min <= draft_max, got draft_min={self.draft_min}, "
                f"draft_max={self.draft_max}"
            )
        if self.mode in ("chain", "tree", "ngram") and self.draft_max < 1:
            raise ValueError(f"SpecConfig.mode={self.mode!r} drafts draft_max >= 1 tokens, got {self.draft_max}")
        if not 0 <= self.p_min < 1:
            raise ValueError(f"SpecConfig.p_min must be in [0, 1), got {self.p_min}")
        if self.min_gain < 0:
            raise ValueError(f"SpecConfig.min_gain must be >= 0, got {self.min_gain}")
        if self.draft_head not in ("int8", "fp32"):
            raise ValueError(f"SpecConfig.draft_head must be int8 or fp32, got {self.draft_head!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"SpecConfig needs 1 <= ngram_min <= ngram_max, got ngram_min={self.ngram_min}, "
                f"ngram_max={self.ngram_max}"
            )

    @property
    def check_tokens(self) -> int:
        """The most positions one check carries: its root and ``draft_max`` drafted nodes, and with
        ``ngram_branch`` up to ``draft_max`` more grafted on from the n-gram lookup (``lookup.find``'s limit).
        A sequence's cache, a ring's slack and a channel request are sized for it."""
        return (2 if self.ngram_branch else 1) * self.draft_max + 1


@dataclass
class SamplingParams:
    """How a token is chosen from the verifier's logits. ``temperature=0`` is greedy; otherwise the logits
    are divided by it, cut to the ``top_k`` largest (0: all), the smallest set holding ``top_p`` of the
    probability and the tokens at least ``min_p`` times as likely as the likeliest, and sampled with a
    generator seeded by ``seed`` (None: a random seed).

    Before either, the logits are shaped by what the sequence holds, as vLLM and OpenAI define it:
    ``logit_bias`` (token id -> a number added to its logit), ``repetition_penalty`` (a logit of a token
    in the prompt or the new text is divided by it if positive, multiplied if not; 1: off), then
    ``frequency_penalty`` times a token's count in the new text and ``presence_penalty`` once if it is
    there are subtracted (0: off). ``json_schema`` (a JSON schema's text) masks every token that would
    leave the text no way to become a document it accepts (``gpu_actor.grammar``); ``grammar`` (an EBNF
    grammar from rule ``root``, llama.cpp's GBNF form) or ``regex`` (the whole text's) do the same for
    their language, one of the three at most. ``min_tokens`` (vLLM's) masks the tokens that end the text
    until it holds that many (not with a language: its end is the language's). Greedy decoding takes the
    shaped argmax.

    ``logprobs`` asks for each new token's log-probability with that many of the likeliest tokens beside it
    (None: none), ``prompt_logprobs`` the same for every prompt token after the first (which turns prefix
    reuse off for the request: reused positions have no logits). They are the verifier's own distribution,
    before any shaping, temperature, top-k, top-p or min-p, as an evaluation harness scores a text."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    json_schema: str | None = None
    grammar: str | None = None
    regex: str | None = None
    min_tokens: int = 0

    def __post_init__(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and not 0 <= k <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be None or in [0, {MAX_LOGPROBS}], got {k}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.seed is not None and not SEEDS[0] <= self.seed <= SEEDS[1]:
            raise ValueError(f"seed must be in [{SEEDS[0]}, {SEEDS[1]}] (torch's generator's), got {self.seed}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: no cut), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0: off), got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY}] (1: off), got {self.repetition_penalty}"
            )
        given = {name: getattr(self, name) for name in CONSTRAINTS if getattr(self, name) is not None}
        for name, text in given.items():
            if not isinstance(text, str):
                raise ValueError(f"{name} must be a text, got {type(text).__name__}")
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)}: a text follows one of {', '.join(CONSTRAINTS)} at most")
        if self.min_tokens < 0 or (self.min_tokens and given):
            raise ValueError(
                f"min_tokens must be >= 0 and 0 with {', '.join(CONSTRAINTS)} (their language ends the text), "
                f"got {self.min_tokens}"
            )
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {token!r}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS}, {MAX_LOGIT_BIAS}], got {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def shaped(self) -> bool:
        """Whether the logits are shaped by bias, penalties or a schema before a token is chosen."""
        penalties = self.repetition_penalty != 1 or bool(self.presence_penalty or self.frequency_penalty)
        return bool(self.logit_bias) or penalties or self.constraint is not None or self.min_tokens > 0

    @property
    def constraint(self) -> tuple[str, str] | None:
        """(kind, text) of the language the text must follow (``CONSTRAINTS``), or None."""
        return next(((name, getattr(self, name)) for name in CONSTRAINTS if getattr(self, name) is not None), None)


@dataclass
class BatchConfig:
    """How the engine actor shares its checks among requests (``gpu_actor.batcher``) and what it admits.

    Up to ``max_batch`` sequences are verified in each pass; up to ``max_queue`` more wait to join between
    checks, and one request beyond either that or ``kv_budget_bytes`` (the K/V of live and waiting
    sequences, plus finished ones kept for prefix reuse) is refused at once, so that a full server answers
    "try later" instead of slowing everyone down. ``prefix_cache_bytes`` of that budget keep finished
    sequences' K/V so that a prompt starting with one (the next turn of a chat) skips its prefill; 0 turns
    reuse off. A request nobody asked about for ``lease_s`` is dropped: its client is gone.
    ``prefill_per_round`` tokens of joining prompts are prefilled between two checks (whole forwards, at
    least one; None: one forward, ``EngineConfig.prefill_chunk``): more lets a prompt in sooner and holds
    up the sequences decoding for longer.
    """

    max_batch: int = 8
    max_queue: int = 32
    kv_budget_bytes: int = 2 * 2**30
    prefix_cache_bytes: int = 512 * 2**20
    lease_s: float = 60.0
    prefill_per_round: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.max_queue < 0:
            raise ValueError(
                f"BatchConfig needs max_batch >= 1 and max_queue >= 0, got {self.max_batch}, {self.max_queue}"
            )
        if not 0 <= self.prefix_cache_bytes <= self.kv_budget_bytes:
            raise ValueError(
                f"BatchConfig needs 0 <= prefix_cache_bytes <= kv_budget_bytes, got {self.prefix_cache_bytes} "
                f"and {self.kv_budget_bytes}"
            )
        if not self.lease_s > 0:
            raise ValueError(f"BatchConfig.lease_s must be > 0, got {self.lease_s}")
        if self.prefill_per_round is not None and self.prefill_per_round < 1:
            raise ValueError(f"BatchConfig.prefill_per_round must be None or >= 1, got {self.prefill_per_round}")


@dataclass
class EngineConfig:
    """The GPU actor's decoding loop (``gpu_actor.engine``).

    ``prefill`` picks the prompt's path: ``"split"`` runs it through the CPU actors in forwards of at most
    ``prefill_chunk`` tokens (each group's rows sent as requests of at most ``channel.max_tokens``, all in
    flight at once, so at most ``channel.slots`` of them); ``"device"`` runs
    it in one forward with the residual brought to ``device`` group by group (``DeviceResidual``);
    ``"auto"`` takes whichever the engine's own timings say is cheaper for the prompt's length
    (``gpu_actor.prefill.choose_prefill``). ``resident_bytes`` of the residual (as the folder stores it) stay
    on ``device``, the same first rows of every group (``kernels.shard.resident_rows``): the engine
    multiplies them itself in every pass, the CPU actors (started with the same figure) skip them; it is the
    plan's VRAM share (``splitspec plan``), 0 leaves all of it to the CPU actors. ``engine_cpus=None`` with
    ``pin=True`` gives the engine the first allowed CPU and the CPU actors the rest, when there are at least
    two: on a 2-vCPU machine the base product and the residual then run side by side instead of fighting
    for one core.
    """

    PREFILL_PATHS = ("auto", "split", "device")  # not a field: no annotation

    max_seq_len: int = 2048
    prefill: str = "auto"
    prefill_chunk: int = 256  # rows a split-path forward carries (timed against 64 and 128: benchmarks/README.md)
    # a forward of a prompt's rows through the CPU actors' slots in this many parts, as a wavefront: the engine
    # finishes one part (rotations, norms, attention) while the actors multiply another's (1: one pass)
    prefill_parts: int = 4
    resident_bytes: int = 0
    device: str = "cpu"
    pin: bool = True
    engine_cpus: tuple[int, ...] | None = None
    channel: ChannelConfig = field(default_factory=ChannelConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    # how the residual multiplies x', on the CPU actors and in DeviceResidual alike (CpuActorConfig.activations)
    activations: str = CpuActorConfig.activations
    # the verifier's lm_head (gpu_actor.heads): "int16" codes under a per-row scale (half the bytes a pass reads),
    # "fp32" as stored, or "bf16" (half the bytes, 8-bit weights and logits); their KL: results/head_precision.json
    head: str = "int16"
    # the CPU actors' part of the int16 lm_head's vocabulary rows on a CPU engine: they multiply theirs while the
    # engine multiplies the rest, so the head's bytes stream on every core (None: equal parts; 0: the engine's)
    head_share: float | None = None
    # the CPU actors' part of every Linear group's 2-bit base (each row's last code words) in a prompt's requests
    # (``protocol.messages.BASE_SHARE_TOKENS`` rows or more) on a CPU engine: their core works while the engine
    # finishes another part of the prompt (``prefill_parts``) and the engine's base shrinks (None:
    # ``actor_base_share``'s default; timed: benchmarks/README.md)
    base_share: float | None = None
    # replay draft steps and one sequence's checks as recorded CUDA graphs (``SplitModel.draft_step``,
    # ``verify_step``): a GPU's step is bound by the host's launches; off until timed on a GPU (gpu_check.py)
    cuda_graphs: bool = False
    # the K/V cache's element: float32 (exact against the reference, and what the CPU's compiled layers read),
    # or bfloat16 / float16 (half the memory, so twice the context a GPU holds: attention then runs at that
    # precision, as llama.cpp's f16 cache and vLLM's do; speculation stays lossless against the same cache)
    kv_dtype: str = "float32"
    # what a sliding-window layer's K/V keeps: "ring", its window plus the slots a check writes (``ring_slack``),
    # so that a long context's K/V is mostly its global layers' (Gemma 4 31B: 50 of 60 layers slide over 1024);
    # "full", every position; "auto", rings on a CUDA device (the CPU's compiled layers read full caches)
    kv_window: str = "auto"

    @property
    def ring_slack(self) -> int:
        """Slots a sliding layer's ring keeps past its window: the most a check writes before it is rolled back
        or compacted (``SpecConfig.check_tokens``), and one more; 0 where caches keep every slot."""
        ring = self.kv_window == "ring" or (self.kv_window == "auto" and self.device.startswith("cuda"))
        return self.spec.check_tokens + 1 if ring else 0

    def check_context(self, positions: int) -> None:
        """Refuse a context longer than the model's positions (``ArchSpec.max_positions``): past them its
        RoPE is one it was never trained at, or (LongRoPE) not the one computed here."""
        if self.max_seq_len > positions:
            raise ValueError(
                f"a context of {self.max_seq_len} tokens (EngineConfig.max_seq_len, --ctx-size) exceeds the "
                f"{positions} positions this model takes: lower it"
            )

    def check_length(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Refuse a sequence that cannot fit the context."""
        if prompt_tokens + max_new_tokens > self.max_seq_len:
            raise ValueError(
                f"{prompt_tokens} prompt + {max_new_tokens} new tokens exceed the context of {self.max_seq_len} "
                "tokens (EngineConfig.max_seq_len, --ctx-size)"
            )

    def __post_init__(self) -> None:
        check_activations(self.activations, "EngineConfig.activations")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"EngineConfig.cuda_graphs records CUDA graphs: it needs device cuda, not {self.device!r}")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"EngineConfig.kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.kv_window not in KV_WINDOWS:
            raise ValueError(f"EngineConfig.kv_window must be one of {', '.join(KV_WINDOWS)}, got {self.kv_window!r}")
        if self.head not in VERIFIER_HEADS:
            raise ValueError(f"EngineConfig.head must be one of {', '.join(VERIFIER_HEADS)}, got {self.head!r}")
        if self.head_share is not None:
            if not 0 <= self.head_share < 1:
                raise ValueError(f"EngineConfig.head_share must be in [0, 1), got {self.head_share}")
            if self.head_share and not self._actors_can_share_head:
                raise ValueError(
                    f"EngineConfig.head_share > 0 needs the int16 head on a CPU engine (the CPU actors' kernel), "
                    f"not head={self.head!r} on {self.device!r}: set head_share=0"
                )
        if self.base_share is not None:
            if not 0 <= self.base_share < 1:
                raise ValueError(f"EngineConfig.base_share must be in [0, 1), got {self.base_share}")
            if self.base_share and not self.device.startswith("cpu"):
                raise ValueError(
                    f"EngineConfig.base_share > 0 hands the CPU actors a part of the base of a CPU engine, not of "
                    f"{self.device!r}: set base_share=0"
                )
            if self.base_share and self.resident_bytes:
                raise ValueError(
                    "EngineConfig.base_share > 0 hands the CPU actors every row's last code words of the base, but "
                    "the engine multiplies its resident_bytes of the residual's rows with their whole base: set "
                    "base_share=0 or resident_bytes=0"
                )
        for name in ("max_seq_len", "prefill_chunk", "prefill_parts"):
            if getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill not in self.PREFILL_PATHS:
            raise ValueError(
                f"EngineConfig.prefill must be one of {', '.join(self.PREFILL_PATHS)}; got {self.prefill!r}"
            )
        if self.resident_bytes < 0:
            raise ValueError(f"EngineConfig.resident_bytes must be >= 0, got {self.resident_bytes}")
        from splitspec.protocol.lane import MAX_SMALL  # the lanes' one-byte row count caps every request

        per_request = min(self.channel.max_tokens, MAX_SMALL)
        in_flight = per_request * self.channel.slots  # a group's requests, all posted before its gather
        if self.prefill_chunk > in_flight:
            raise ValueError(
                f"EngineConfig.prefill_chunk ({self.prefill_chunk}) exceeds the rows a group can have in flight "
                f"(min(ChannelConfig.max_tokens, {MAX_SMALL}) × slots = {per_request} × {self.channel.slots})"
            )
        if self.spec.check_tokens > self.channel.max_tokens:
            branch = " and as many grafted n-grams" if self.spec.ngram_branch else ""
            raise ValueError(
                f"a check of SpecConfig.draft_max = {self.spec.draft_max} nodes{branch} carries up to "
                f"{self.spec.check_tokens} positions, more than one channel request holds (ChannelConfig.max_tokens"
                f" = {self.channel.max_tokens})"
            )
        if not self.device.startswith(("cpu", "cuda")):
            raise ValueError(f"EngineConfig.device must be cpu or cuda[:N], got {self.device!r}")
        if self.engine_cpus is not None:
            self.engine_cpus = tuple(sorted(set(self.engine_cpus)))
            if not self.engine_cpus or self.engine_cpus[0] < 0:
                raise ValueError(f"EngineConfig.engine_cpus must be non-empty CPU ids >= 0, got {self.engine_cpus}")

    @property
    def _actors_can_share_head(self) -> bool:
        """The CPU actors' kernel multiplies the int16 head, beside an engine on the CPU."""
        return self.head == "int16" and self.device.startswith("cpu")

    def actor_base_share(self) -> float:
        """The part of every group's base that the CPU actors multiply in a prompt's requests (``base_share``):
        ``BASE_SHARE`` on a CPU engine whose base runs the byte tables and that holds none of the residual,
        none on a GPU or where this host's AMX tiles run a prompt's base (the share would move it off the
        tiles onto the byte tables: not timed there)."""
        if self.base_share is not None:
            return self.base_share
        if not self.device.startswith("cpu") or self.resident_bytes:
            return 0.0
        from splitspec.kernels import amx  # numba and LLVM: only where an engine is being started

        return 0.0 if self.activations == "int16" and amx.enabled() else BASE_SHARE

    def actor_head_share(self, n_actors: int) -> float:
        """The part of the lm_head's rows that ``n_actors`` CPU actors multiply (``head_share``): by default an
        equal part per process on a CPU engine with the int16 head, none otherwise (a GPU reads its own head
        far faster than a CPU actor could)."""
        if self.head_share is not None:
            return self.head_share
        if not self._actors_can_share_head or n_actors < 1:
            return 0.0
        return n_actors / (n_actors + 1)


@dataclass(frozen=True)
class SchedulerConfig:
    """How the scheduler on Ray (``scheduler.cluster``) reaches a cluster and supervises the actors.

    ``address=None`` joins a running cluster a user started when it answers (``RAY_ADDRESS``, or the
    last ``ray start --head``) and otherwise starts an embedded one, which no other process's
    ``address=None`` joins; ``"local"`` always starts one; anything else is that cluster's
    address, and not finding it is an error. ``quiet`` keeps the actors' own output in Ray's log files
    instead of interleaving it with the generated text. ``actor_hosts`` names, per CPU actor, a custom
    resource of the Ray node it must run on (a host started with ``ray start --resources='{"host2": 1}'``);
    empty, or None for an actor, keeps it on the engine's node. (Ray refuses to add a worker node that runs
    with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: start that one with ``=1``.)
    """

    address: str | None = None
    node_ip: str = "127.0.0.1"
    num_cpus: int | None = None  # an embedded cluster's logical CPUs (default: the CPUs this process may use)
    object_store_bytes: int = 200 * 2**20  # only set-up crosses Ray; the store lives in /dev/shm
    cpu_actors: int = 1  # how many CPU actors share the residual rows
    actor_hosts: tuple[str | None, ...] = ()
    row_weights: tuple[float, ...] = ()  # each CPU actor's share of the rows; () = the read bandwidth of its CPUs
    max_restarts: int = 3
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 30.0  # a command's teardown after Ctrl-C; then it kills what it started (deploy.stopping)
    quiet: bool = True

    def __post_init__(self) -> None:
        if self.cpu_actors < 1:
            raise ValueError(f"SchedulerConfig.cpu_actors must be >= 1, got {self.cpu_actors}")
        if self.row_weights and (len(self.row_weights) != self.cpu_actors or min(self.row_weights) <= 0):
            shares = self.row_weights
            raise ValueError(f"SchedulerConfig.row_weights needs {self.cpu_actors} positive shares, got {shares}")
        if self.actor_hosts and len(self.actor_hosts) != self.cpu_actors:
            raise ValueError(
                f"SchedulerConfig.actor_hosts names {len(self.actor_hosts)} hosts for {self.cpu_actors} CPU actors"
            )
        if self.max_restarts < 0:
            raise ValueError(f"SchedulerConfig.max_restarts must be >= 0, got {self.max_restarts}")
        for name in ("start_timeout_s", "stop_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SchedulerConfig.{name} must be > 0, got {getattr(self, name)}")

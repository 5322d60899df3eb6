"""An unfinished conversion's work folder: what lets an interrupted conversion resume where it stopped.

Converting a 30B model streams for hours; a reboot or a killed process must not cost the layers already
done. The work folder sits beside the output, ``.{out}.partial``, outside the converted folder's format
(the output only appears, renamed whole, when the conversion is complete), and holds:

- ``state.json``: the settings it was started with (the source's weights' and config.json's hashes, every
  ``ConvertConfig`` field, the layer count, the splitspec version), the base's Lloyd–Max levels once
  fitted, and how many layers are done;
- ``activations.safetensors``: both calibration streams' hidden states after the last finished layer, with
  that layer count in its metadata;
- ``parts/``: the base and residual tensors written so far (``concat.PartFiles``), keyed by layer;
- ``folder/``: the converted folder, assembled there at the end and renamed to the output.

A layer counts as done only once its parts and the activations after it are written (each file is written
beside its name and renamed), and ``state.json`` says so, or the activations do where a process stopped
between the two renames; so a process killed at any point leaves a state that resumes to the same bytes:
the parts of a layer it had not finished are discarded and the layer is converted again. A run with other
settings refuses the folder rather than mixing two conversions.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from splitspec.models.files import CorruptFileError, safetensors_header
from splitspec.quantize.concat import PartFiles, save_tensors, whole_file

STATE = "state.json"
ACTIVATIONS = "activations.safetensors"
LAYER_PREFIX = "layer"


class ResumeError(FileExistsError):
    """The output's work folder holds an unfinished conversion with other settings."""


class DiskFullError(OSError):
    """The output's disk (or the user's quota on it) filled up; what was finished stays in the work folder."""


FULL = (errno.ENOSPC, errno.EDQUOT)  # the errors of a write that found no room


def layer_key(layer: int, group: str) -> str:
    """The part key of a layer's group: the layer number leads so an unfinished layer's parts can be told."""
    return f"{LAYER_PREFIX}{layer:06d}.{group}"


def work_path(out: Path) -> Path:
    return out.parent / f".{out.name}.partial"


def check_room(out: Path, planned: dict[str, int]) -> None:
    """Refuse, before any work, a conversion whose files cannot fit on the output's disk: ``planned`` (each
    file's bytes, a lower bound) once as parts and files together, plus the largest file twice while it
    is assembled from its parts, less what an interrupted run's work folder already holds."""
    path = work_path(out)
    kept = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0
    total = sum(planned.values())
    need = total + max(planned.values()) - kept
    free = shutil.disk_usage(out.parent).free
    if free < need:
        raise DiskFullError(
            f"converting into {out} needs at least {need / 1e9:.2f} GB more on its disk (a {total / 1e9:.2f} GB "
            f"folder, its largest file twice while it is assembled), {free / 1e9:.2f} GB free: free space there "
            "or choose another output folder"
        )


class WorkFolder:
    """Opens the work folder of ``out``: a new one, or an interrupted one started with the same settings."""

    def __init__(self, out: Path, settings: dict[str, Any]) -> None:
        self.path = work_path(out)
        self.settings = json.loads(json.dumps(settings, default=str))  # as it reads back from state.json
        self.levels: list[float] | None = None
        self.layers_done = 0
        state_path = self.path / STATE
        if state_path.is_file():
            state = json.loads(state_path.read_text())
            if state["settings"] != self.settings:
                old, new = _flat(state["settings"]), _flat(self.settings)
                differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
                raise ResumeError(
                    f"{self.path} holds an unfinished conversion into {out.name} with other settings "
                    f"({', '.join(differ)} differ); re-run it with the same ones to resume, or remove {self.path} "
                    "to start over"
                )
            self.levels, self.layers_done = state["levels"], self._layers_done(state["layers_done"])
        elif self.path.exists():  # killed before its first state: nothing worth keeping
            shutil.rmtree(self.path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.parts = PartFiles(self.path / "parts")
        self.parts.discard(lambda key: key.startswith(LAYER_PREFIX) and _layer_of(key) >= self.layers_done)
        self.folder = self.path / "folder"  # where the output is assembled: its files are whole, so they stay
        self._write_state()

    def save_levels(self, levels: list[float]) -> None:
        self.levels = levels
        self._write_state()

    def checkpoint(self, layers_done: int, h_ref: torch.Tensor, h_base: torch.Tensor) -> None:
        """Layers ``< layers_done`` are finished and their parts written; the streams' states after them."""
        count = {"layers_done": str(layers_done)}
        save_tensors({"h_ref": h_ref, "h_base": h_base}, self.path / ACTIVATIONS, count)
        self.layers_done = layers_done
        self._write_state()

    def _layers_done(self, recorded: int) -> int:
        """The layers done: ``recorded`` by the state, or one more where the process stopped between writing
        the activations after a layer and the state that says so. That layer's parts were all written before
        its activations, so it is finished; converted again, it would be fed its own output."""
        path = self.path / ACTIVATIONS
        start_over = f"this work folder cannot be resumed; remove {self.path} to start over"
        if not path.is_file():
            if recorded:
                raise CorruptFileError(path, f"missing, but {STATE} says {recorded} layers are done: {start_over}")
            return 0
        saved = (safetensors_header(path).get("__metadata__") or {}).get("layers_done")
        if saved not in (str(recorded), str(recorded + 1)):
            raise CorruptFileError(
                path,
                f"holds the activations after {saved or 'an unrecorded number of'} layers, but {STATE} says "
                f"{recorded} are done: {start_over}",
            )
        return int(saved)

    def activations(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The two streams' hidden states after the last finished layer (``layers_done`` > 0)."""
        from safetensors import safe_open

        with safe_open(self.path / ACTIVATIONS, framework="pt") as f:
            return f.get_tensor("h_ref"), f.get_tensor("h_base")

    def finish(self, out: Path) -> None:
        """Rename the assembled folder to ``out`` and drop the rest."""
        os.replace(self.folder, out)
        shutil.rmtree(self.path)

    def disk_full(self, error: OSError) -> DiskFullError:
        """The error to raise where a write found the output's disk full: what is kept, and how to go on."""
        free = shutil.disk_usage(self.path).free
        return DiskFullError(
            f"no space left on the disk of {self.path.parent} ({error.strerror}; {free / 1e9:.2f} GB free now): "
            f"{self.layers_done} of {self.settings['n_layers']} layers are done and kept in {self.path}; free "
            "space there and run the same command again to resume",
        )

    def _write_state(self) -> None:
        state = {"settings": self.settings, "levels": self.levels, "layers_done": self.layers_done}
        with whole_file(self.path / STATE) as f:
            f.write(json.dumps(state, indent=1).encode())


def _flat(settings: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested settings as dotted names, so that a refusal can say which setting differs."""
    out: dict[str, Any] = {}
    for k, v in settings.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v}
    return out


def _layer_of(key: str) -> int:
    return int(key.removeprefix(LAYER_PREFIX).split(".", 1)[0])

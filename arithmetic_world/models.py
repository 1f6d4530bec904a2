"""One-call, offline loader for the embedded world's target, draft and judge."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from generation.paths import REPO_ROOT

if TYPE_CHECKING:  # torch and transformers load with the first model, not with the world's registration
    import torch
    from transformers import PreTrainedTokenizerFast

DEFAULT_ROOT = REPO_ROOT / "checkpoints" / "arithmetic"
ROLES = ("target", "draft", "judge")
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


@dataclass
class WorldModels:
    """The world's loaded models (eval mode) and their shared tokenizer."""

    target: torch.nn.Module
    draft: torch.nn.Module
    judge: torch.nn.Module
    tokenizer: PreTrainedTokenizerFast
    root: Path


def world_root(root: Optional[str | os.PathLike] = None, *, must_exist: bool = False) -> Path:
    """Where the world's models live: ``root``, else ``$SEMANTICSPEC_WORLD``, else ``checkpoints/arithmetic``.

    Raises:
        FileNotFoundError: ``must_exist`` and no such folder, saying where the models ship and how to point at them.
    """
    path = Path(root or os.environ.get("SEMANTICSPEC_WORLD") or DEFAULT_ROOT)
    if must_exist and not path.is_dir():
        raise FileNotFoundError(_missing(f"world folder {path}", "python -m arithmetic_world.train --out DIR"))
    return path


def _missing(what: str, train: str) -> str:
    """Why the world's models are not there and how to get them (``train``: the command that trains what is
    missing)."""
    return (f"{what} does not exist: the embedded world's models ship in a clone of the repository "
            "(checkpoints/arithmetic), not in a wheel; set SEMANTICSPEC_WORLD to a folder holding target/, draft/ "
            f"and judge/, or train them with `{train}`, then `python -m arithmetic_world.card --publish DIR --root "
            "WORLD` and set SEMANTICSPEC_WORLD=WORLD")


def model_dir(role: str, root: Optional[str | os.PathLike] = None) -> Path:
    """Folder of one of the world's models, checked to be complete."""
    if role not in ROLES:
        raise ValueError(f"role={role!r}; expected one of {ROLES}")
    path = world_root(root) / role
    if not path.is_dir():
        raise FileNotFoundError(_missing(f"world model folder {path}",
                                         f"python -m arithmetic_world.train --which {role} --out DIR"))
    missing = [f for f in REQUIRED_FILES if not (path / f).is_file()]
    if missing:
        raise FileNotFoundError(f"world model folder {path} is incomplete: missing {', '.join(missing)}")
    return path


def load_model(role: str, root: Optional[str | os.PathLike] = None, device: str = "cpu", dtype=None):
    """Load one world model offline, in eval mode (``dtype`` None: float32)."""
    import torch
    from transformers import AutoModelForCausalLM

    from generation.loading import quiet_loading

    dtype = torch.float32 if dtype is None else dtype

    from safetensors import SafetensorError

    path = model_dir(role, root)
    try:
        with quiet_loading():
            return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).to(device).eval()
    except SafetensorError as e:  # a cut or overwritten download: named, as every other bad world folder
        raise ValueError(f"world model {path / 'model.safetensors'} is damaged ({e}); restore it (a clone's "
                         "checkpoints/, or git checkout) or train it again") from None


def load_tokenizer(root: Optional[str | os.PathLike] = None, role: str = "target") -> PreTrainedTokenizerFast:
    """The world's shared tokenizer, offline, from the folder of ``role`` (every folder holds the same one)."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast.from_pretrained(model_dir(role, root), local_files_only=True)


def load_world(root: Optional[str | os.PathLike] = None, device: str = "cpu") -> WorldModels:
    """Load target, draft and judge with their tokenizer. Raises naming any missing folder or file."""
    root = world_root(root, must_exist=True)
    return WorldModels(*(load_model(r, root, device) for r in ROLES), load_tokenizer(root), root)

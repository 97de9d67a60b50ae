"""A decode graph's passed check, kept beside its package: a later start that loads the same package with
the same code does not run the check again (`proven`).

Why. The check (`decode_graph_check.py`) runs several steps of the model, a prompt's among them, before a
graph serves: a large share of a warm start, and the same answer at every start of the same package with
the same code. What the answer depends on:
- the package's key (`decode_graph.graph_key`): the model's weights, torch, the CPU, the features in use,
  the attention kernel;
- the package's bytes: the compiled code itself;
- gracelm's own code (its Python files and compiled kernels): the code that calls the graph and computes
  eager's reference, and the check itself;
- the thread count, which may change how a parallel loop splits a sum.
The proof holds all but the key (its file is named by the key). A proof that does not match proves
nothing: the check runs, and a pass writes it anew. A graph that failed its check gets none; a cache that
cannot be written costs the check at the next start, nothing else.

Kept: `<cache>/graphs/<key>.proof` (JSON), pruned with its package (`decode_graph._prune`).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import json
import logging
from pathlib import Path

import torch

from gracelm.cache_dir import write_atomic

logger = logging.getLogger(__name__)

SUFFIX = ".proof"


def proven(package: Path) -> bool:
    """Whether the package at `package` passed its check at an earlier start, with this code and threads."""
    try:
        kept = json.loads(proof_path(package).read_bytes())
    except (OSError, ValueError):
        return False
    try:
        return kept == _statement(package)
    except OSError:  # the package went meanwhile: its load has failed or will
        return False


def keep_proof(package: Path) -> None:
    """Records that the package at `package` passed its check."""
    try:
        write_atomic(proof_path(package), json.dumps(_statement(package), sort_keys=True).encode())
    except OSError as e:
        logger.warning("decode graph: cannot keep the proof of %s's check (%s); the next start checks it "
                       "again", package.name, e)


def proof_path(package: Path) -> Path:
    return package.with_suffix(SUFFIX)


def _statement(package: Path) -> dict[str, str | int]:
    """What a proof of `package` states: its bytes, gracelm's code and the thread count."""
    return {"package": hashlib.sha256(package.read_bytes()).hexdigest(), "code": code_digest(),
            "threads": torch.get_num_threads()}


@functools.cache
def code_digest() -> str:
    """A digest of the installed gracelm's code: every Python file and compiled library of the package, by
    its path inside the package and its bytes."""
    root = Path(__file__).resolve().parents[1]
    suffixes = (".py", *importlib.machinery.EXTENSION_SUFFIXES)
    files = sorted(path for path in root.rglob("*") if path.is_file() and path.name.endswith(suffixes))
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()

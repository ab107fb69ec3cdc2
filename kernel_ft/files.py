"""
What a run reads and writes, checked before the work and written whole.

* Output safety (``check_output_path`` / ``write_json_atomic``): a run that trains
  for an hour and then cannot write its results has lost them, so every output
  path is checked before a model is built, and files are written to a temporary
  name and renamed (strict JSON: NaN becomes null), whole or not at all. A file is
  replaced only if this project wrote it (``written_here``), and a run never
  writes into what it reads (``input_paths``).
* Errors as one line (``one_line``): the reason, not a traceback.

The first of the workload's files: it imports none of them. Nothing runs on import.
"""

import contextlib
import json
import os
import tempfile

def check_output_path(path, flag, directory=False, inputs=(), suffix=None):
    """Fail now, in one line, if ``path`` cannot be written or must not be; return it
    absolute.

    A run that trains for minutes and then cannot write its results has lost them,
    so every script checks its output paths before it builds a model. And an output
    must never destroy what the user has: it may not be, or be inside, one of the
    run's ``inputs`` ((flag, path) pairs, see input_paths), and an existing file is
    replaced only if this project wrote it (written_here). ``suffix``: the one
    extension the file may have (its format). ``directory``: the path is a folder
    to create (or reuse), not a file.
    """
    path = os.path.abspath(os.path.expanduser(path))
    real = os.path.realpath(path)  # through symbolic links, as the write would go
    for input_flag, source in inputs:
        if real == source or real.startswith(source.rstrip(os.sep) + os.sep):
            where = "is" if real == source else "is inside"
            raise SystemExit(f"error: {flag} {path}: {where} the {input_flag} input {source}; a run never writes "
                             f"into what it reads")
    if directory:
        if os.path.exists(path) and not os.path.isdir(path):
            raise SystemExit(f"error: {flag} {path}: exists and is not a directory")
        parent = path if os.path.isdir(path) else os.path.dirname(path)
        while not os.path.exists(parent):  # the first existing ancestor must let us create the rest
            parent = os.path.dirname(parent)
    else:
        if os.path.isdir(path):
            raise SystemExit(f"error: {flag} {path}: is a directory, expected a file path")
        if suffix and not path.lower().endswith(suffix):
            raise SystemExit(f"error: {flag} {path}: expected a {suffix} file")
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            raise SystemExit(f"error: {flag} {path}: directory {parent} does not exist")
        if os.path.exists(os.path.join(parent, CHECKPOINT_MANIFEST)):
            raise SystemExit(f"error: {flag} {path}: is inside the checkpoint {parent}, which a write would damage; "
                             f"choose a path outside it")
        if os.path.exists(path) and not written_here(path):
            raise SystemExit(f"error: {flag} {path}: exists and was not written by this project; remove it or "
                             f"choose another path")
    try:  # os.access says yes to root everywhere; creating a file is the real test
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        raise SystemExit(f"error: {flag} {path}: cannot write in {parent} ({e.strerror})") from None
    return path


def input_paths(args):
    """[(flag, real path)] of what a run reads from disk: the dataset file, a model
    folder, the checkpoint it resumes. Outputs are checked against them."""
    found = []
    for flag in ("--dataset", "--model", "--resume"):
        value = getattr(args, flag[2:], None)
        if value and os.path.exists(os.path.expanduser(value)):
            found.append((flag, os.path.realpath(os.path.expanduser(value))))
    return found


# Every JSON file and figure this project writes says so: a file with the mark may
# be replaced by a later run, any other file is the user's and is never touched.
PROJECT = "kernel-ft"
WRITTEN_BY = "written_by"  # the JSON key; figures carry PROJECT as their PNG "Software" text
PNG_METADATA = {"Software": PROJECT}  # savefig(..., metadata=PNG_METADATA)
CHECKPOINT_MANIFEST = "manifest.json"  # in every checkpoint folder (checkpoints.py): no output goes in there


def written_here(path):
    """Whether the file at ``path`` carries this project's mark (write_json_atomic, PNG_METADATA)."""
    try:
        if path.lower().endswith(".json"):
            with open(path) as f:
                doc = json.load(f)
            return isinstance(doc, dict) and doc.get(WRITTEN_BY) == PROJECT
        if path.lower().endswith(".png"):
            from PIL import Image  # installed with matplotlib

            with Image.open(path) as image:
                return image.text.get("Software") == PROJECT
    except (OSError, ValueError):  # unreadable or not that format: not ours
        return False
    return False


def check_input_file(path, flag):
    """Fail now, in one line, if ``path`` is not a readable file; return it absolute."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise SystemExit(f"error: {flag} {path}: no such file")
    if not os.access(path, os.R_OK):
        raise SystemExit(f"error: {flag} {path}: not readable")
    return path


def strict_json(value):
    """``value`` with every float NaN or infinity replaced by None: JSON has no NaN,
    and a file with a bare NaN in it is rejected by most JSON readers."""
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return None
    if isinstance(value, dict):
        return {str(k): strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def write_json_atomic(path, doc):
    """Write ``doc`` (a dict) as strict JSON to a temporary file beside ``path``, then
    rename it: a reader (or a crash) never sees half a file, and an older file at
    ``path`` stays whole until the new one is complete. The file's first key is
    this project's mark (WRITTEN_BY), so that a later run may replace it. The
    temporary file's name is new (mkstemp): no file of the user's is replaced by it."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".", suffix=".json.tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(strict_json({WRITTEN_BY: PROJECT, **doc}), f, indent=2, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # no half-written temporary file left behind
            os.remove(tmp)
        raise


# --------------------------------------------------------------------------------
# Errors in one line
# --------------------------------------------------------------------------------
def one_line(exc):
    """An exception as one short line: the reason, not the traceback."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first[:200]}"

"""argparse types for the files and folders a benchmark writes.

Checked when the command line is parsed, before anything is measured: a
folder where a file goes (a file where a folder goes), or a new file or
folder that cannot be made where it is named (a read-only or missing
place), is a one-line usage error instead of a traceback after the
measurement. An existing regular file must be one that can be written
(appended to) where it is: a read-only one (or one like
``/proc/version``) is refused too, though ``--replot`` and ``--table``
only read it (copy a read-only results file somewhere writable to draw
it); the check writes nothing into it. Other existing targets (a pipe,
``/dev/stdout``, ``/dev/null``) are taken as they are, not opened. A
leading ``~`` is expanded (``--out=~/x.csv``, where the shell does not).
No JAX or torch import (the torch benchmarks use it too).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile


def int_at_least(lo: int):
  """An argparse ``type=``: an int >= ``lo`` (a clean usage error
  otherwise). The benchmarks' counts take it from here, which imports no
  JAX (pallas_kernels' own CLI has its ``autotune.positive_int``)."""
  def parse(s: str) -> int:
    try:
      v = int(s)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < lo:
      raise argparse.ArgumentTypeError(f"{v} must be >= {lo}")
    return v
  return parse


def _why(e: OSError) -> str:
  return e.strerror or str(e)


def out_file(path: str) -> str:
  """A file a benchmark writes (a CSV it appends to, a plot), ``~``
  expanded. An existing regular file must be writable: one ``os.access``
  says is not is refused, and one it passes is opened for appending,
  sought to its end (where an append starts) and closed, nothing written,
  as root may pass ``os.access`` on a file that takes no writes
  (``/proc/version``); another existing target (a pipe, a device) is
  taken as it is. A missing one is created once, its missing folders made
  for it, and what this check made is removed again."""
  path = os.path.expanduser(path)
  full = os.path.abspath(path)
  if os.path.isdir(full):
    raise argparse.ArgumentTypeError(f"{path!r} is a folder; give a file")
  if os.path.exists(full):
    if not os.path.isfile(full):  # (a pipe, /dev/stdout: not opened)
      return path
    if not os.access(full, os.W_OK):
      raise argparse.ArgumentTypeError(
          f"cannot write {path!r}: the file exists and is not writable")
    try:
      fd = os.open(full, os.O_WRONLY | os.O_APPEND)
      try:
        os.lseek(fd, 0, os.SEEK_END)
      finally:
        os.close(fd)
    except OSError as e:
      raise argparse.ArgumentTypeError(
          f"cannot write {path!r}: {_why(e)}") from None
    return path
  with _made_folders(path, os.path.dirname(full)):
    fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    os.close(fd)
    os.remove(full)
  return path


def out_file_or_stdout(path: str) -> str:
  """:func:`out_file`, or ``-`` (standard output)."""
  return path if path == "-" else out_file(path)


def out_dir(path: str) -> str:
  """A folder a benchmark writes files into (``~`` expanded): a file
  created in it once and removed; the folder, if missing, made for that
  and removed again."""
  path = os.path.expanduser(path)
  full = os.path.abspath(path)
  if os.path.exists(full) and not os.path.isdir(full):
    raise argparse.ArgumentTypeError(f"{path!r} is a file; give a folder")
  with _made_folders(path, full):
    with tempfile.TemporaryFile(dir=full):
      pass
  return path


@contextlib.contextmanager
def _made_folders(path: str, folder: str):
  """Makes ``folder`` (and its missing parents) for the body, then removes
  the ones it made; an ``OSError`` of either becomes the usage error that
  names ``path``."""
  missing, f = [], folder
  while not os.path.exists(f) and os.path.dirname(f) != f:
    missing.append(f)
    f = os.path.dirname(f)
  try:
    try:
      os.makedirs(folder, exist_ok=True)
      yield
    finally:
      for f in missing:  # deepest first
        if os.path.isdir(f):
          os.rmdir(f)
  except OSError as e:
    raise argparse.ArgumentTypeError(
        f"cannot write {path!r}: {_why(e)}") from None

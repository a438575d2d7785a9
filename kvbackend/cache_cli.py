"""``kvbackend cache``: inspect and maintain a disk-tier cache directory.

    kvbackend cache stats  DIR [--json]
    kvbackend cache verify DIR [--delete] [--no-progress] [--key-file FILE]   exit 1 if bad
    kvbackend cache clear  DIR [--model DIGEST_PREFIX]

``--model`` matches a prefix of the identity digest (directory name) or of the
model fingerprint recorded in ``identity.json``. All three see only the current
format's ``v2`` tree and follow no symlink in it; ``clear`` removes only files
it defines (block, temp, bound and identity files), never other files, nor a
``v1`` tree of an older format. ``verify`` checks keyed trees with the key from
``--key-file`` or ``$KVBACKEND_DISK_KEY``, and skips (never deletes) those
whose key it does not hold.
Exit codes: 0 success, 1 bad files found (verify), 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TextIO

from kvbackend.store.block_file import CorruptBlock, KeyedBlock
from kvbackend.store.checksum_key import KEY_ENV, key_id, load_checksum_key
from kvbackend.store.disk_bound import is_declaration_name
from kvbackend.store.layout import BOUNDS_DIR, IDENTITY_FILE
from kvbackend.store.safe_fs import unlink_in
from kvbackend.store.scan import IdentityDir, block_files, identity_dirs, verify_file


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class ProgressBar:
    """A one-line text progress bar on a stream, redrawn at most every ``interval`` s."""

    def __init__(self, total: int, stream: TextIO, *, width: int = 30, interval: float = 0.1,
                 enabled: bool = True) -> None:
        self.total, self.stream, self.width = total, stream, width
        self.interval, self.enabled = interval, enabled
        self._last = 0.0

    def update(self, done: int, nbytes: int, *, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self._last < self.interval):
            return
        self._last = now
        frac = done / self.total if self.total else 1.0
        filled = int(frac * self.width)
        bar = "#" * filled + "-" * (self.width - filled)
        self.stream.write(f"\rverify [{bar}] {done}/{self.total} files, {human_bytes(nbytes)}")
        self.stream.flush()

    def close(self, done: int, nbytes: int) -> None:
        self.update(done, nbytes, force=True)
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _cmd_stats(args: argparse.Namespace) -> int:
    rows = []
    for ident in identity_dirs(args.dir):
        blocks = temps = nbytes = 0
        for entry in block_files(ident.path):
            if entry.is_temp:
                temps += 1
            else:
                blocks += 1
                nbytes += entry.size
        info = ident.identity or {}
        rows.append(dict(identity=ident.digest, model=ident.model_fingerprint,
                         kv_dtype=info.get("kv_dtype"), block_size=info.get("block_size"),
                         kv_layout=info.get("kv_layout"), tp_rank=info.get("tp_rank"),
                         tp_size=info.get("tp_size"), entries=blocks, bytes=nbytes,
                         temp_files=temps))
    total_entries = sum(r["entries"] for r in rows)
    total_bytes = sum(r["bytes"] for r in rows)
    if args.json:
        print(json.dumps(dict(directory=str(args.dir), entries=total_entries, bytes=total_bytes,
                              identities=rows), indent=1))
        return 0
    print(f"{args.dir}: {total_entries} blocks, {human_bytes(total_bytes)} "
          f"({total_bytes} bytes) in {len(rows)} identities")
    if rows:
        print(f"{'IDENTITY':<14}{'MODEL':<14}{'DTYPE':<10}{'BLOCK':>6} {'TP':>5}"
              f"{'BLOCKS':>9}{'BYTES':>12}{'TMP':>5}")
    for r in rows:
        tp = "?" if r["tp_rank"] is None else f"{r['tp_rank']}/{r['tp_size']}"
        print(f"{r['identity'][:12]:<14}{(r['model'] or '?')[:12]:<14}"
              f"{str(r['kv_dtype'] or '?')[:9]:<10}{str(r['block_size'] or '?'):>6} {tp:>5}"
              f"{r['entries']:>9}{human_bytes(r['bytes']):>12}{r['temp_files']:>5}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    try:
        checksum_key = load_checksum_key(args.key_file)
    except ValueError as e:
        print(f"kvbackend: {e}", file=sys.stderr)
        return 2
    held = None if checksum_key is None else key_id(checksum_key)
    files, skipped = [], 0
    for ident in identity_dirs(args.dir):
        entries = [e for e in block_files(ident.path) if not e.is_temp]
        if ident.checksum_key_id is not None and ident.checksum_key_id != held:
            skipped += len(entries)  # keyed with a key we do not hold
            continue
        key = checksum_key if ident.checksum_key_id is not None else None
        files += [(ident, key, e) for e in entries]
    progress = ProgressBar(len(files), sys.stderr, enabled=not args.no_progress)
    bad: list[tuple[str, str]] = []
    checked_bytes = 0
    for done, (ident, key, entry) in enumerate(files, 1):
        try:
            verify_file(entry.path, ident.digest, entry.key, checksum_key=key)
        except FileNotFoundError:
            continue  # evicted meanwhile
        except KeyedBlock:
            skipped += 1
            continue
        except (CorruptBlock, OSError) as e:
            bad.append((entry.path, str(e)))
            if args.delete:
                entry.remove()
        checked_bytes += entry.size
        progress.update(done, checked_bytes)
    progress.close(len(files), checked_bytes)
    for path, reason in bad:
        print(f"BAD {path}: {reason}{' (deleted)' if args.delete else ''}")
    skip_note = (f", {skipped} skipped (keyed; no matching key in --key-file or {KEY_ENV})"
                 if skipped else "")
    print(f"verified {len(files)} block files, {human_bytes(checked_bytes)}: "
          f"{len(files) - len(bad)} ok, {len(bad)} bad{skip_note}")
    return 1 if bad else 0


def _remove_identity(ident: IdentityDir) -> tuple[int, int]:
    """Remove an identity directory's own files, then its directories if empty.
    Nothing is followed (see scan); foreign files stay, and so do their directories."""
    files = nbytes = 0
    subdirs = set()
    for entry in block_files(ident.path):
        if not entry.remove():
            continue
        subdirs.add(entry.directory)
        if not entry.is_temp:
            files += 1
            nbytes += entry.size
    bounds = os.path.join(ident.path, BOUNDS_DIR)
    try:
        for name in filter(is_declaration_name, os.listdir(bounds)):
            unlink_in(bounds, name)
    except OSError:
        pass
    unlink_in(ident.path, IDENTITY_FILE)
    for path in [*sorted(subdirs - {ident.path}), bounds, ident.path]:
        try:
            os.rmdir(path)
        except OSError:
            pass  # not empty (a concurrent writer, or a foreign file), or a link: leave it
    return files, nbytes


def _cmd_clear(args: argparse.Namespace) -> int:
    idents = identity_dirs(args.dir)
    chosen = [i for i in idents if args.model is None or i.matches(args.model)]
    if args.model is not None and not chosen:
        present = ", ".join(f"{i.digest[:12]} (model {(i.model_fingerprint or '?')[:12]})"
                            for i in idents) or "none"
        print(f"no identity matches model prefix {args.model!r}; present: {present}")
        return 0
    files = nbytes = 0
    for ident in chosen:
        f, b = _remove_identity(ident)
        files += f
        nbytes += b
    print(f"removed {files} block files, {human_bytes(nbytes)} ({nbytes} bytes), "
          f"from {len(chosen)} of {len(idents)} identities")
    return 0


def add_parser(top: argparse._SubParsersAction) -> None:
    cache = top.add_parser("cache", help="inspect or maintain a disk-tier cache directory",
                           description=__doc__.split("\n\n")[0])
    cache.set_defaults(run=run)
    sub = cache.add_subparsers(dest="command", required=True)
    p = sub.add_parser("stats", help="blocks and bytes per identity")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_stats)
    p = sub.add_parser("verify", help="check every block file's checksum (exit 1 if any is bad)")
    p.add_argument("dir")
    p.add_argument("--delete", action="store_true", help="delete bad files")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--key-file", help=f"checksum key of keyed trees (default: ${KEY_ENV})")
    p.set_defaults(func=_cmd_verify)
    p = sub.add_parser("clear", help="delete cached blocks")
    p.add_argument("dir")
    p.add_argument("--model", metavar="DIGEST_PREFIX",
                   help="only identities whose digest or model fingerprint starts with this")
    p.set_defaults(func=_cmd_clear)


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.dir):
        print(f"kvbackend: {args.dir} is not a directory", file=sys.stderr)
        return 2
    return args.func(args)

"""API keys: who a caller is, their limits and their prefix-cache group.

Keys come from ``PD_API_KEYS`` (plain keys, the settings' limits, each its own cache group)
and from ``PD_KEYS_FILE``, a YAML or TOML file that stores only each key's SHA-256::

    keys:
      - name: acme-batch            # shown in metrics and usage; never the key itself
        sha256: 9f86d081...         # pdserve keys hash <key>
        tokens_per_minute: 20000    # optional; default PD_RATE_LIMIT_TOKENS_PER_MINUTE
        requests_per_minute: 600    # optional; default PD_RATE_LIMIT_REQUESTS_PER_MINUTE
        max_concurrent_requests: 8  # optional; default PD_MAX_CONCURRENT_REQUESTS_PER_KEY
        cache_salt: acme            # optional: keys with one cache_salt share prefix-cache blocks

The file is read again when its modification time changes (checked at most every
``PD_KEYS_RELOAD_INTERVAL_S``) or on SIGHUP; a file that fails to parse keeps the keys in
force and logs the error.
"""

from __future__ import annotations

import hashlib
import os
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

import yaml

from shared.config import Settings, SettingsError
from shared.logging import get_logger

log = get_logger("gateway.keys")

FIELDS = {"name", "sha256", "tokens_per_minute", "requests_per_minute", "max_concurrent_requests", "cache_salt"}


def hash_key(key: str) -> str:
    """The SHA-256 hex digest of an API key: what the keys file stores."""
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Tenant:
    """An authenticated caller. ``name`` labels metrics and usage; ``cache_salt`` is the
    prefix-cache group (requests with different salts never share KV blocks); the limits
    are per ``window_s`` (0 = none)."""

    name: str
    tokens_per_minute: int = 0
    requests_per_minute: int = 0
    max_concurrent_requests: int = 0
    cache_salt: str = ""


def group_salt(group: str) -> str:
    """The cache salt of an organisation's ``cache_salt`` group; the ``org-`` prefix keeps it
    apart from every key's own salt (16 hex digits of the key's hash)."""
    return "org-" + hashlib.sha256(f"org:{group}".encode()).hexdigest()[:16]


def tenant_of(entry: dict, settings: Settings) -> tuple[str, Tenant]:
    """(key hash, tenant) of one keys-file entry.

    Raises:
        SettingsError: a missing or malformed field.
    """
    unknown = set(entry) - FIELDS
    if unknown:
        raise SettingsError(f"unknown field(s) {sorted(unknown)} in keys file entry {entry.get('name')!r}")
    name, digest = entry.get("name"), str(entry.get("sha256", "")).lower()
    if not isinstance(name, str) or not name or len(name) > 64 or not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise SettingsError(f"keys file: name {name!r} must be 1-64 letters, digits, '-', '_' or '.'")
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise SettingsError(f"keys file: {name}: sha256 must be 64 hex digits (pdserve keys hash <key>)")
    limits = {}
    for field, default in (("tokens_per_minute", settings.rate_limit_tokens_per_minute),
                           ("requests_per_minute", settings.rate_limit_requests_per_minute),
                           ("max_concurrent_requests", settings.max_concurrent_requests_per_key)):
        value = entry.get(field, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise SettingsError(f"keys file: {name}: {field} must be a whole number >= 0")
        limits[field] = value
    group = entry.get("cache_salt")
    if group is not None and (not isinstance(group, str) or not group):
        raise SettingsError(f"keys file: {name}: cache_salt must be a non-empty string")
    return digest, Tenant(name=name, cache_salt=group_salt(group) if group else digest[:16], **limits)


def parse_keys_file(path: Path, settings: Settings) -> dict[str, Tenant]:
    """Key hash → tenant, from a YAML (``.yaml``/``.yml``) or TOML (``.toml``) file.

    Raises:
        SettingsError: unreadable, unparsable, or an invalid entry (duplicate names included).
        OSError: the file cannot be read.
    """
    text = path.read_text()
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise SettingsError(f"keys file {path}: {exc}") from None
    entries = (data or {}).get("keys", []) if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise SettingsError(f"keys file {path}: expected a 'keys' list of tables")
    out: dict[str, Tenant] = {}
    for entry in entries:
        digest, tenant = tenant_of(entry, settings)
        if any(t.name == tenant.name for t in out.values()):
            raise SettingsError(f"keys file {path}: name {tenant.name!r} appears twice")
        out[digest] = tenant
    return out


class KeyRing:
    """The keys in force: ``PD_API_KEYS`` plus ``PD_KEYS_FILE``, reloaded on change.

    Raises (constructor):
        SettingsError: the keys file is invalid at start.
    """

    def __init__(self, settings: Settings):
        self.settings = settings
        self.path = Path(settings.keys_file).expanduser() if settings.keys_file else None
        self.env_keys = {}
        for key in (k.strip() for k in settings.api_keys.split(",")):
            if key:
                digest = hash_key(key)
                self.env_keys[digest] = Tenant(f"key-{digest[:8]}", settings.rate_limit_tokens_per_minute,
                                               settings.rate_limit_requests_per_minute,
                                               settings.max_concurrent_requests_per_key, digest[:16])
        self.file_keys: dict[str, Tenant] = {}
        self.mtime_ns: int | None = None
        self.checked_at = time.monotonic()  # the file was just read
        self.reload_asked = False
        if self.path is not None:
            try:
                self.mtime_ns = self.path.stat().st_mtime_ns
                self.file_keys = parse_keys_file(self.path, settings)
            except OSError as exc:
                raise SettingsError(f"PD_KEYS_FILE={settings.keys_file!r}: {exc.strerror or exc}") from None

    @property
    def is_on(self) -> bool:
        return bool(self.env_keys or self.path)

    def lookup(self, key: str) -> Tenant | None:
        """The tenant of a plain key, or None. (The lookup is by SHA-256, so the time it
        takes says nothing about the stored keys.)"""
        self.maybe_reload()
        digest = hash_key(key)
        return self.file_keys.get(digest) or self.env_keys.get(digest)

    def ask_reload(self) -> None:
        """Read the file again at the next lookup (the SIGHUP handler)."""
        self.reload_asked = True

    def maybe_reload(self) -> bool:
        """Re-read the keys file when asked or when its mtime changed; True when reloaded."""
        if self.path is None:
            return False
        now = time.monotonic()
        if not self.reload_asked and now - self.checked_at < self.settings.keys_reload_interval_s:
            return False
        self.checked_at = now
        try:
            mtime = os.stat(self.path).st_mtime_ns
            if not self.reload_asked and mtime == self.mtime_ns:
                return False
            self.reload_asked, self.mtime_ns = False, mtime  # a bad file is reported once per change
            keys = parse_keys_file(self.path, self.settings)
        except (OSError, SettingsError) as exc:
            log.error("keys_file_reload_failed", path=str(self.path), error=str(exc))
            self.reload_asked = False
            return False
        self.file_keys = keys
        log.info("keys_file_reloaded", path=str(self.path), num_keys=len(keys))
        return True


def main(argv: list[str] | None = None) -> int:
    """``python -m services.gateway.tenancy.keys hash [KEY]``: print the SHA-256 line of a keys file
    for KEY (read from stdin when not given, which keeps it out of the shell's history)."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m services.gateway.tenancy.keys")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("hash", help="SHA-256 of an API key, for the keys file").add_argument("key", nargs="?")
    args = parser.parse_args(argv)
    key = args.key if args.key is not None else sys.stdin.readline().strip()
    if not key:
        parser.error("empty key")
    print(hash_key(key))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

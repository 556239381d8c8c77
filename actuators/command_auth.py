"""Signed control commands: the envelope, its HMAC, and the checks an agent makes before running one.

A command travels as canonical JSON (sorted keys, no spaces, ASCII), version 1::

    {"args":{"destination":"10.0.2.0/24","dev":"eth1"},"command":"route.set",
     "expires_at":1718000030000000000,"issued_at":1718000000000000000,
     "key":"3f2a…:route.set:h3","node":"h3","nonce":"9c1d…","v":1}

``node`` names the agent it is for, so a command signed for one node cannot be replayed at
another (the replay cache is per agent). The gRPC metadata carries ``x-ridethrough-key-id``
and ``x-ridethrough-signature``: hex HMAC-SHA256, under that key, of a domain tag and the
exact payload bytes. The agent checks, in this order, and refuses with a `Reason`:

1. a signature and a key id are there, the key id is one it accepts, the HMAC matches
   (constant-time) — before the payload is parsed at all;
2. the payload is a well-formed version-1 command in canonical form, for this node;
3. its lifetime is no longer than ``max_lifetime_s``, it is not expired and not issued in the
   future, each within ``max_clock_skew_s``;
4. its nonce was not seen before: nonces are remembered until their command expires, in a
   bounded cache that refuses new commands when full of live nonces rather than forget one.

Secrets are loaded from a file or an environment variable, ``KEY_ID=HEX`` entries; they never
appear in a repr, a log line or an error message.
"""

from __future__ import annotations

import enum
import hashlib
import heapq
import hmac
import json
import re
import secrets
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

VERSION = 1
SIGNATURE_HEADER = "x-ridethrough-signature"
KEY_ID_HEADER = "x-ridethrough-key-id"
MIN_SECRET_BYTES = 32
_DOMAIN = b"ridethrough-control-v1\n"  # a signature made here means nothing in any other protocol
_FIELDS = frozenset({"v", "key", "node", "command", "args", "issued_at", "expires_at", "nonce"})
_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@-]{0,199}")
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,252}")
_COMMAND = re.compile(r"[a-z][a-z0-9_]*(\.[a-z][a-z0-9_]*){0,3}")
_ARG_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
_NONCE = re.compile(r"[0-9a-f]{32,64}")
_KEY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_MAX_NS = 2**63 - 1
Scalar = str | int | float | bool
"""An argument value: commands take scalars only (version 1)."""


class Reason(enum.StrEnum):
    """Why an agent refused a command (the ``reason`` label of the refusal counter)."""

    MISSING_SIGNATURE = "missing_signature"
    UNKNOWN_KEY = "unknown_key"
    BAD_SIGNATURE = "bad_signature"
    MALFORMED = "malformed"
    WRONG_NODE = "wrong_node"
    LIFETIME_TOO_LONG = "lifetime_too_long"
    EXPIRED = "expired"
    NOT_YET_VALID = "not_yet_valid"
    REPLAYED = "replayed"
    REPLAY_CACHE_FULL = "replay_cache_full"
    UNKNOWN_COMMAND = "unknown_command"
    BAD_ARGS = "bad_args"
    KEY_CONFLICT = "key_conflict"
    IN_PROGRESS = "in_progress"


class Refused(Exception):
    """A command the agent will not run; ``command`` is set once the payload was authentic and parsed."""

    def __init__(self, reason: Reason, message: str, command: Command | None = None) -> None:
        super().__init__(f"{reason.value}: {message}")
        self.reason = reason
        self.message = message
        self.command = command


class KeyRingError(ValueError):
    """Control keys that cannot be used; the message names the source and the key id, never a secret."""


@dataclass(frozen=True, slots=True)
class Command:
    """One control command, as signed."""

    key: str
    """Idempotency key: a command with a key that already ran is answered from the stored reply."""
    node: str
    command: str
    args: Mapping[str, Scalar]
    issued_at_ns: int
    expires_at_ns: int
    nonce: str

    @classmethod
    def new(cls, *, key: str, node: str, command: str, args: Mapping[str, Scalar], now_ns: int,
            lifetime_s: float) -> Command:
        """A command issued at ``now_ns``, valid for ``lifetime_s``, with a fresh random nonce."""
        cmd = cls(key, node, command, dict(args), now_ns, now_ns + int(lifetime_s * 1e9), secrets.token_hex(16))
        decode_command(cmd.encode())  # the sender fails on what the agent would refuse as malformed
        return cmd

    def encode(self) -> bytes:
        """The canonical payload bytes (what is signed and sent)."""
        doc = {"v": VERSION, "key": self.key, "node": self.node, "command": self.command, "args": dict(self.args),
               "issued_at": self.issued_at_ns, "expires_at": self.expires_at_ns, "nonce": self.nonce}
        return _canonical(doc)

    def fingerprint(self) -> str:
        """What the command does (name and args), to tell a retry from a reused key."""
        return hashlib.sha256(_canonical({"command": self.command, "args": dict(self.args)})).hexdigest()


def _canonical(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number")


def decode_command(raw: bytes) -> Command:
    """Parse and validate a payload strictly; ValueError says what is wrong."""
    try:
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"payload is not JSON: {exc}") from exc
    if not isinstance(doc, dict):
        raise ValueError(f"payload is a JSON {type(doc).__name__}, not an object")
    if set(doc) != _FIELDS:
        missing, extra = sorted(_FIELDS - set(doc)), sorted(set(doc) - _FIELDS)
        raise ValueError(f"payload fields wrong: missing {missing}, unexpected {extra}")
    if doc["v"] != VERSION or type(doc["v"]) is not int:
        raise ValueError(f"unsupported version {doc['v']!r}; this agent speaks version {VERSION}")
    _text(doc, "key", _KEY)
    _text(doc, "node", _NODE)
    _text(doc, "command", _COMMAND)
    _text(doc, "nonce", _NONCE)
    for name in ("issued_at", "expires_at"):
        if type(doc[name]) is not int or not 0 < doc[name] <= _MAX_NS:
            raise ValueError(f"{name} must be a positive integer of nanoseconds since the epoch, got {doc[name]!r}")
    if doc["expires_at"] <= doc["issued_at"]:
        raise ValueError("expires_at must be after issued_at")
    args = doc["args"]
    if not isinstance(args, dict):
        raise ValueError(f"args must be an object, got {type(args).__name__}")
    for name, value in args.items():
        if not _ARG_NAME.fullmatch(name):
            raise ValueError(f"argument name {name!r} is not lower_snake_case")
        if not isinstance(value, str | int | float):  # bool is an int
            raise ValueError(f"argument {name!r} must be a string, number or boolean, got {type(value).__name__}")
    cmd = Command(doc["key"], doc["node"], doc["command"], args, doc["issued_at"], doc["expires_at"], doc["nonce"])
    if cmd.encode() != raw:
        raise ValueError("payload is not in canonical form (sorted keys, no whitespace, ASCII escapes)")
    return cmd


def _text(doc: Mapping[str, Any], name: str, pattern: re.Pattern[str]) -> None:
    value = doc[name]
    if not isinstance(value, str) or not pattern.fullmatch(value):
        raise ValueError(f"{name} {value!r} does not match {pattern.pattern}")


@dataclass(frozen=True)
class KeyRing:
    """HMAC keys by key id; several at once so that keys can be rotated without downtime."""

    _keys: Mapping[str, bytes] = field(repr=False)

    def __post_init__(self) -> None:
        for key_id, secret in self._keys.items():
            if not _KEY_ID.fullmatch(key_id):
                raise KeyRingError(f"control key id {key_id!r} does not match {_KEY_ID.pattern}")
            if len(secret) < MIN_SECRET_BYTES:
                raise KeyRingError(f"control key {key_id!r} is {len(secret)} bytes; at least {MIN_SECRET_BYTES} "
                                   f"are needed (make one with `openssl rand -hex {MIN_SECRET_BYTES}`)")

    def __repr__(self) -> str:
        return f"KeyRing(ids={list(self.ids)})"

    @property
    def ids(self) -> tuple[str, ...]:
        """The key ids held, sorted."""
        return tuple(sorted(self._keys))

    def only(self, ids: Iterable[str]) -> KeyRing:
        """The keys among ``ids`` (all of them must be held)."""
        wanted = set(ids)
        if unknown := sorted(wanted - set(self._keys)):
            raise KeyRingError(f"control key ids {unknown} are not loaded; loaded: {list(self.ids)}")
        return KeyRing({k: v for k, v in self._keys.items() if k in wanted})

    def sign(self, key_id: str, payload: bytes) -> str:
        """The hex signature of ``payload`` under ``key_id``."""
        if key_id not in self._keys:
            raise KeyRingError(f"no control key {key_id!r}; loaded: {list(self.ids)}")
        return hmac.new(self._keys[key_id], _DOMAIN + payload, hashlib.sha256).hexdigest()

    def verify(self, key_id: str, payload: bytes, signature: str) -> Reason | None:
        """None if ``signature`` is right for ``payload`` under ``key_id``, else why not."""
        secret = self._keys.get(key_id)
        if secret is None:
            return Reason.UNKNOWN_KEY
        expected = hmac.new(secret, _DOMAIN + payload, hashlib.sha256).hexdigest()
        return None if hmac.compare_digest(expected.encode(), signature.encode("ascii", "replace")) else \
            Reason.BAD_SIGNATURE


def parse_keys(text: str, *, source: str) -> dict[str, bytes]:
    """``KEY_ID=HEX`` entries, one per line or comma-separated (``#`` starts a comment)."""
    keys: dict[str, bytes] = {}
    for n, line in enumerate(text.splitlines(), 1):
        for entry in line.split("#", 1)[0].split(","):
            if not entry.strip():
                continue
            key_id, sep, hexed = (part.strip() for part in entry.partition("="))
            where = f"{source} line {n}"
            if not sep or not key_id:
                raise KeyRingError(f"{where}: expected KEY_ID=HEX_SECRET")
            if key_id in keys:
                raise KeyRingError(f"{where}: control key id {key_id!r} appears twice")
            try:
                keys[key_id] = bytes.fromhex(hexed)
            except ValueError:
                raise KeyRingError(f"{where}: the secret of key {key_id!r} is not hex") from None
    return keys


def load_keyring(*, file: str = "", env_var: str = "", environ: Mapping[str, str]) -> KeyRing:
    """The keys of ``file`` and of the variable ``env_var`` of ``environ`` (either may be unset; not both)."""
    keys: dict[str, bytes] = {}
    if file:
        path = Path(file)
        try:
            keys.update(parse_keys(path.read_text(), source=str(path)))
        except OSError as exc:
            raise KeyRingError(f"cannot read control keys from {path}: {exc.strerror}") from exc
    if env_var and environ.get(env_var):
        for key_id, secret in parse_keys(environ[env_var], source=f"${env_var}").items():
            if key_id in keys:
                raise KeyRingError(f"control key id {key_id!r} is both in {file} and in ${env_var}")
            keys[key_id] = secret
    if not keys:
        where = " or ".join(filter(None, [file, f"${env_var}" if env_var else ""])) or "no source given"
        raise KeyRingError(f"no control keys found ({where}); expected KEY_ID=HEX_SECRET entries")
    return KeyRing(keys)


class ReplayCache:
    """Nonces seen, each kept until its command expires; at most ``capacity`` at a time."""

    def __init__(self, *, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"replay cache capacity must be at least 1, got {capacity}")
        self._capacity = capacity
        self._until: dict[str, int] = {}
        self._heap: list[tuple[int, str]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._until)

    def admit(self, nonce: str, *, keep_until_ns: int, now_ns: int) -> Reason | None:
        """Remember ``nonce``; None if it is new, else why the command must be refused."""
        with self._lock:
            while self._heap and self._heap[0][0] < now_ns:
                _, old = heapq.heappop(self._heap)
                del self._until[old]
            if nonce in self._until:
                return Reason.REPLAYED
            if len(self._until) >= self._capacity:
                return Reason.REPLAY_CACHE_FULL  # forgetting a live nonce would let its command replay
            self._until[nonce] = keep_until_ns
            heapq.heappush(self._heap, (keep_until_ns, nonce))
            return None


class Authenticator:
    """The agent's checks on a signed command (see the module docstring); `check` raises `Refused`."""

    def __init__(self, *, keys: KeyRing, node_id: str, max_clock_skew_s: float, max_lifetime_s: float,
                 replay_capacity: int, clock: Callable[[], int]) -> None:
        self._keys = keys
        self.node_id = node_id
        self._skew_ns = int(max_clock_skew_s * 1e9)
        self._max_lifetime_ns = int(max_lifetime_s * 1e9)
        self._replays = ReplayCache(capacity=replay_capacity)
        self._clock = clock

    def check(self, raw: bytes, metadata: Mapping[str, str]) -> Command:
        """The command in ``raw`` if it may run; `Refused` otherwise."""
        signature, key_id = metadata.get(SIGNATURE_HEADER, ""), metadata.get(KEY_ID_HEADER, "")
        if not signature or not key_id:
            raise Refused(Reason.MISSING_SIGNATURE, f"calls must carry {SIGNATURE_HEADER} and {KEY_ID_HEADER}")
        bad = self._keys.verify(key_id, raw, signature)
        if bad is Reason.UNKNOWN_KEY:
            raise Refused(bad, f"key id {key_id[:64]!r} is not accepted here")
        if bad is not None:
            raise Refused(bad, f"signature does not match the payload under key {key_id!r}")
        try:
            cmd = decode_command(raw)
        except ValueError as exc:
            raise Refused(Reason.MALFORMED, str(exc)) from None
        if cmd.node != self.node_id:
            raise Refused(Reason.WRONG_NODE, f"command is for node {cmd.node!r}, this is {self.node_id!r}", cmd)
        self._check_time(cmd)
        why = self._replays.admit(cmd.nonce, keep_until_ns=cmd.expires_at_ns + self._skew_ns, now_ns=self._clock())
        if why is Reason.REPLAYED:
            raise Refused(why, f"nonce {cmd.nonce} was already used", cmd)
        if why is not None:
            raise Refused(why, f"{len(self._replays)} unexpired commands are remembered; retry later", cmd)
        return cmd

    def _check_time(self, cmd: Command) -> None:
        now = self._clock()
        lifetime = cmd.expires_at_ns - cmd.issued_at_ns
        if lifetime > self._max_lifetime_ns:
            raise Refused(Reason.LIFETIME_TOO_LONG, f"lifetime {lifetime / 1e9:.3f} s exceeds the "
                          f"{self._max_lifetime_ns / 1e9:g} s allowed", cmd)
        if now > cmd.expires_at_ns + self._skew_ns:
            raise Refused(Reason.EXPIRED, f"expired {(now - cmd.expires_at_ns) / 1e9:.3f} s ago "
                          f"(clock skew allowance {self._skew_ns / 1e9:g} s)", cmd)
        if cmd.issued_at_ns > now + self._skew_ns:
            raise Refused(Reason.NOT_YET_VALID, f"issued {(cmd.issued_at_ns - now) / 1e9:.3f} s in the future "
                          f"(clock skew allowance {self._skew_ns / 1e9:g} s)", cmd)

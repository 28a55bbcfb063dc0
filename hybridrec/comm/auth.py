"""Authentication between a job's servers and clients: ZeroMQ CURVE keys from one job key.

A job key is 32 random bytes, written as 64 hex digits. Every role of the job gets the same
key, through the environment, never the command line (where `ps` shows it to every user):
`HYBRIDREC_AUTH_KEY` holds the key itself (what `hybridrec launch` hands its children), or
`HYBRIDREC_AUTH_KEY_FILE` names a file that holds it and that only its owner may read (mode
0600; `python -m hybridrec.comm.auth new FILE` writes one).

Two CURVE key pairs derive from the job key, one for servers and one for clients. A server's
ROUTER socket is a CURVE server with the server pair; a ZAP handler on its context admits only
connections that present the client pair's public key. Clients verify the server's public key in
the handshake, so neither side talks to a peer without the job key, and every frame is encrypted
and authenticated (libsodium, inside libzmq; CurveZMQ's nonces refuse replayed messages).

A server bound to a loopback address (127.0.0.0/8, ::1, localhost) needs no key; anywhere
else it refuses to start without one (`server_key`). A client uses the key whenever one is
configured, so every role of a job must see the same setting.
"""
from __future__ import annotations

import hashlib
import ipaddress
import logging
import os
import secrets
import stat
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import zmq
from zmq.utils import z85

from hybridrec.comm.log_limit import RateLimitedLog

AUTH_KEY_ENV = "HYBRIDREC_AUTH_KEY"
AUTH_KEY_FILE_ENV = "HYBRIDREC_AUTH_KEY_FILE"
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks a context's ZAP handler
ZAP_DOMAIN = b"hybridrec"
HOW_TO = (f"give every role of the job the same key through {AUTH_KEY_FILE_ENV} (a 0600 file made by "
          f"`python -m hybridrec.comm.auth new FILE`) or {AUTH_KEY_ENV} (see docs/distributed.md, Security)")
POLL_MS = 50

log = logging.getLogger(__name__)


class AuthError(ValueError):
    """A missing, malformed or refused job key."""


@dataclass(frozen=True, repr=False)
class JobKey:
    """The CURVE key pairs (Z85 bytes) of one job key; `secret` is the key as written to files."""

    secret: str
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:  # never print the secret
        return f"JobKey(server_public={self.server_public.decode()!r})"

    @classmethod
    def from_text(cls, text: str, source: str) -> "JobKey":
        """The key written as 64 hex digits (surrounding white space ignored); `source` names
        where it came from in the error (the key itself is never shown)."""
        secret = text.strip()
        try:
            raw = bytes.fromhex(secret)
        except ValueError:
            raw = b""
        if len(raw) != 32 or len(secret) != 64:
            raise AuthError(f"{source} must hold a job key of 64 hex digits, got {len(secret)} characters "
                            f"that are not one; {HOW_TO}")
        pairs = []
        for role in (b"server", b"client"):
            role_secret = z85.encode(hashlib.sha256(b"hybridrec curve " + role + b" " + raw).digest())
            pairs += [zmq.curve_public(role_secret), role_secret]
        return cls(secret, *pairs)

    @classmethod
    def new(cls) -> "JobKey":
        return cls.from_text(secrets.token_hex(32), "a new key")

    def http_token(self) -> str:
        """The bearer token of the job's HTTP servers (`hybridrec serve`): derived from the job
        key, so one key secures every server of a job, and a token seen on the wire does not
        give away the key or the CURVE pairs."""
        raw = bytes.fromhex(self.secret)
        return hashlib.sha256(b"hybridrec http token " + raw).hexdigest()

    def secure_server(self, socket: zmq.Socket) -> None:
        """Make `socket` (before it binds) a CURVE server that the ZAP handler vets."""
        socket.curve_server = True
        socket.curve_secretkey = self.server_secret
        socket.curve_publickey = self.server_public
        socket.zap_domain = ZAP_DOMAIN
        socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: no connection

    def secure_client(self, socket: zmq.Socket) -> None:
        """Make `socket` (before it connects) a CURVE client of this job's servers."""
        socket.curve_serverkey = self.server_public
        socket.curve_secretkey = self.client_secret
        socket.curve_publickey = self.client_public


class _FromEnvironment:
    def __repr__(self) -> str:
        return "FROM_ENVIRONMENT"


FROM_ENVIRONMENT = _FromEnvironment()  # a `key` argument: read HYBRIDREC_AUTH_KEY(_FILE)


def read_key_file(path: str | Path, source: str | None = None) -> JobKey:
    """The job key in file `path`, which only its owner may read."""
    source = source or f"key file {str(path)!r}"
    try:
        info = os.stat(path)
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise AuthError(f"{source} may be read by other users (mode {stat.S_IMODE(info.st_mode):04o}); "
                            f"allowed: 0600 or 0400 (chmod 600 {path})")
        text = Path(path).read_text()
    except OSError as error:
        raise AuthError(f"{source} cannot be read: {error.strerror}; {HOW_TO}") from None
    except UnicodeDecodeError:
        text = ""
    return JobKey.from_text(text, source)


def key_from_environment(environ: Mapping[str, str] | None = None) -> JobKey | None:
    """The job key that HYBRIDREC_AUTH_KEY or HYBRIDREC_AUTH_KEY_FILE gives, or None."""
    environ = os.environ if environ is None else environ
    text, path = environ.get(AUTH_KEY_ENV), environ.get(AUTH_KEY_FILE_ENV)
    if text is not None and path is not None:
        raise AuthError(f"both {AUTH_KEY_ENV} and {AUTH_KEY_FILE_ENV} are set; set one of them")
    if text is not None:
        return JobKey.from_text(text, f"environment variable {AUTH_KEY_ENV}")
    if path is not None:
        return read_key_file(path, f"{AUTH_KEY_FILE_ENV}={path!r}")
    return None


def resolve_key(key: "JobKey | None | _FromEnvironment") -> JobKey | None:
    """`key` itself, or the environment's when it is FROM_ENVIRONMENT."""
    if key is FROM_ENVIRONMENT:
        return key_from_environment()
    if key is not None and not isinstance(key, JobKey):
        raise TypeError(f"key must be a JobKey, None or FROM_ENVIRONMENT, got {type(key).__name__}")
    return key


def is_loopback(host: str) -> bool:
    """Whether `host` (a bind or connect host) names only this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # '*', 0.0.0.0's relatives, interface and host names: not provably loopback
        return False


def server_key(host: str, key: "JobKey | None | _FromEnvironment" = FROM_ENVIRONMENT) -> JobKey | None:
    """The key a server bound to `host` uses; AuthError when `host` is not loopback and there is none."""
    key = resolve_key(key)
    if key is None and not is_loopback(host):
        raise AuthError(f"host {host!r} is not a loopback address, so a server there must authenticate "
                        f"its clients and needs the job key; {HOW_TO}")
    return key


def write_key_file(path: str | Path, key: JobKey | None = None) -> JobKey:
    """Write `key` (a new one by default) to a new file `path` that only its owner can read."""
    key = key or JobKey.new()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(key.secret + "\n")
    return key


FULL_STATUS = 500  # the ZAP status of a connection refused because the server serves as many as it may


class ZapHandler:
    """Admits connections on one ZeroMQ context: with `key`, CURVE connections that present its
    client public key; without, NULL (plain) ones. `refusal()` may refuse an otherwise admitted
    connection with a reason (a server at its connection cap), status FULL_STATUS.

    Start it before a socket of the context binds; stop it before the context terminates.
    Refusals are logged, one line each, rate-limited.
    """

    def __init__(self, context: zmq.Context, key: JobKey | None,
                 refusal: Callable[[], str | None] = lambda: None):
        self._socket = context.socket(zmq.REP)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(ZAP_ENDPOINT)
        self._key = key
        self._refusal = refusal
        self._stop = threading.Event()
        self._refusals = RateLimitedLog(log)
        self._thread = threading.Thread(target=self._serve, name="zap-handler", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while not self._stop.is_set():
                if self._socket.poll(POLL_MS, zmq.POLLIN):
                    self._socket.send_multipart(self._answer(self._socket.recv_multipart()))
        finally:
            self._socket.close()

    def _answer(self, request: list[bytes]) -> list[bytes]:
        version, request_id, _domain, address, _identity, mechanism, *credentials = request + [b""] * 6
        peer, kind = address.decode(errors="replace"), mechanism.decode(errors="replace")
        if self._key is None:
            admitted = mechanism == b"NULL"
        else:
            admitted = (mechanism == b"CURVE" and len(credentials) >= 1
                        and z85.encode(credentials[0]) == self._key.client_public)
        if not admitted:
            self._refusals.warning("refused a %s connection from %s: it did not present this job's key", kind, peer)
            return [version, request_id, b"400", b"not this job's key", b"", b""]
        why = self._refusal()
        if why is not None:
            self._refusals.warning("refused a connection from %s: %s", peer, why)
            return [version, request_id, str(FULL_STATUS).encode(), why.encode()[:255], b"", b""]
        return [version, request_id, b"200", b"OK", b"", b""]

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m hybridrec.comm.auth", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    new = commands.add_parser("new", help="write a new job key to a new file only you can read (0600)")
    new.add_argument("file")
    commands.add_parser("http-token", help=f"print the bearer token of `hybridrec serve` for the job key of "
                        f"{AUTH_KEY_FILE_ENV} or {AUTH_KEY_ENV}")
    args = parser.parse_args(argv)
    if args.command == "http-token":
        key = key_from_environment()
        if key is None:
            parser.error(f"no job key: {HOW_TO}")
        print(key.http_token())
        return 0
    try:
        write_key_file(args.file)
    except OSError as error:
        parser.error(f"cannot create key file {args.file!r}: {error.strerror}")
    print(f"wrote a new job key to {args.file}; give it to every role with {AUTH_KEY_FILE_ENV}={args.file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CurveZMQ for the worker's two ROUTER sockets (ingress, bootstrap) and their clients.

A server socket gets its key pair and a ZAP authenticator, private to its own ZMQ context,
that admits only the client public keys found in one directory (``zmq.auth`` certificate
files). A client not in the directory never completes the handshake: its messages never
reach the application, and it gets no reply.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


@dataclass(frozen=True, slots=True)
class CurveServerKeys:
    """A server socket's key pair and the directory of allowed client public keys."""

    public_key: bytes
    secret_key: bytes
    authorized_keys_dir: str

    @classmethod
    def from_files(cls, secret_key_file: str, authorized_keys_dir: str) -> CurveServerKeys:
        """Read a ``zmq.auth`` secret certificate and name the directory of public ones."""
        public, secret = zmq.auth.load_certificate(secret_key_file)
        if secret is None:
            raise ValueError(f"{secret_key_file}: has no secret key (a .key_secret file?)")
        if not os.path.isdir(authorized_keys_dir):
            raise ValueError(f"{authorized_keys_dir}: not a directory of client public keys")
        return cls(public, secret, authorized_keys_dir)


@dataclass(frozen=True, slots=True)
class CurveClientKeys:
    """A client's own key pair and the server's public key."""

    public_key: bytes
    secret_key: bytes
    server_public_key: bytes

    @classmethod
    def from_files(cls, secret_key_file: str, server_public_key_file: str) -> CurveClientKeys:
        public, secret = zmq.auth.load_certificate(secret_key_file)
        server_public, _ = zmq.auth.load_certificate(server_public_key_file)
        if secret is None:
            raise ValueError(f"{secret_key_file}: has no secret key")
        return cls(public, secret, server_public)


def start_server(
    ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes], keys: CurveServerKeys
) -> ThreadAuthenticator:
    """Make ``sock`` (not yet bound) a CURVE server; the caller stops the authenticator."""
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=keys.authorized_keys_dir)
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_server = True
    return auth


def apply_client(sock: zmq.Socket[Any], keys: CurveClientKeys) -> None:
    """Make ``sock`` (not yet connected) a CURVE client of the server named in ``keys``."""
    sock.curve_secretkey = keys.secret_key
    sock.curve_publickey = keys.public_key
    sock.curve_serverkey = keys.server_public_key

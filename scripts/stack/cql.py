#!/usr/bin/env python3
"""Runs CQL statements as a role, over TLS: what the secure stack needs to
set up its roles before any driver is installed.

    cql.py HOST PORT CA_FILE USER 'STATEMENT' ['STATEMENT' ...]

The password is read from the environment (CQL_PASSWORD), never from the
command line. It speaks the native protocol v4 with the stdlib only:
STARTUP, SASL PLAIN through AUTH_RESPONSE, then one QUERY per statement at
consistency ONE. Exits 0 when every statement succeeded, 3 when the login
was refused, and 1 on any other error, printing Cassandra's message.
"""
import os
import socket
import ssl
import struct
import sys

from probe import recv_exact

OP_ERROR, OP_STARTUP, OP_READY, OP_AUTHENTICATE = 0x00, 0x01, 0x02, 0x03
OP_QUERY, OP_RESULT, OP_AUTH_RESPONSE, OP_AUTH_SUCCESS = 0x07, 0x08, 0x0F, 0x10


def short_string(s):
    b = s.encode()
    return struct.pack(">H", len(b)) + b


def send(sock, opcode, body):
    sock.sendall(struct.pack(">BBhBi", 0x04, 0, 1, opcode, len(body)) + body)


def receive(sock):
    _version, _flags, _stream, opcode, length = struct.unpack(">BBhBi", recv_exact(sock, 9))
    return opcode, recv_exact(sock, length)


def error_message(body):
    code, length = struct.unpack(">iH", body[:6])
    return code, body[6 : 6 + length].decode(errors="replace")


class Refused(Exception):
    pass


def login(sock, user, password):
    send(sock, OP_STARTUP, struct.pack(">H", 1) + short_string("CQL_VERSION") + short_string("3.0.0"))
    opcode, body = receive(sock)
    if opcode == OP_READY:
        return
    if opcode != OP_AUTHENTICATE:
        raise RuntimeError(f"unexpected answer to STARTUP: opcode {opcode}")
    token = b"\x00" + user.encode() + b"\x00" + password.encode()
    send(sock, OP_AUTH_RESPONSE, struct.pack(">i", len(token)) + token)
    opcode, body = receive(sock)
    if opcode == OP_ERROR:
        raise Refused(error_message(body)[1])
    if opcode != OP_AUTH_SUCCESS:
        raise RuntimeError(f"unexpected answer to AUTH_RESPONSE: opcode {opcode}")


def query(sock, statement):
    q = statement.encode()
    send(sock, OP_QUERY, struct.pack(">i", len(q)) + q + struct.pack(">HB", 0x0001, 0))
    opcode, body = receive(sock)
    if opcode == OP_ERROR:
        raise RuntimeError(f"{statement!r}: {error_message(body)[1]}")
    if opcode != OP_RESULT:
        raise RuntimeError(f"{statement!r}: unexpected opcode {opcode}")


def main():
    host, port, ca, user = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    # Verifies the chain and that the certificate names the node's address.
    context = ssl.create_default_context(cafile=ca)
    try:
        with socket.create_connection((host, port), timeout=10) as raw:
            with context.wrap_socket(raw, server_hostname=host) as sock:
                login(sock, user, os.environ["CQL_PASSWORD"])
                for statement in sys.argv[5:]:
                    query(sock, statement)
    except Refused as e:
        print(f"cql.py: login as {user} refused: {e}", file=sys.stderr)
        sys.exit(3)
    except (OSError, RuntimeError, struct.error) as e:
        print(f"cql.py: {e}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()

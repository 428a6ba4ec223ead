#!/usr/bin/env python3
"""Asks a local server whether it answers its own protocol, not just TCP.

    probe.py cql HOST PORT     CQL OPTIONS -> SUPPORTED
    probe.py kafka HOST PORT   ApiVersions -> a well-formed response
    probe.py redis HOST PORT   PING -> +PONG
    probe.py KIND-tls HOST PORT  the same over TLS, trusting the CA file in
                               $PROBE_CA; a Redis that wants a login first
                               may answer -NOAUTH

Exit 0 when the server answered as expected, 1 otherwise. Stdlib only, so it
runs before anything is installed.
"""
import os
import socket
import ssl
import struct
import sys


def recv_exact(sock, n):
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed early")
        buf += chunk
    return buf


def cql(sock):
    # v4 frame header: version, flags, stream, opcode OPTIONS (0x05), body length 0.
    sock.sendall(struct.pack(">BBhBi", 0x04, 0, 1, 0x05, 0))
    version, _flags, _stream, opcode, length = struct.unpack(">BBhBi", recv_exact(sock, 9))
    recv_exact(sock, length)
    return version == 0x84 and opcode == 0x06  # response frame, SUPPORTED


def kafka(sock):
    client_id = b"tally-probe"
    # ApiVersions (key 18) v0: api_key, api_version, correlation_id, client_id.
    body = struct.pack(">hhih", 18, 0, 42, len(client_id)) + client_id
    sock.sendall(struct.pack(">i", len(body)) + body)
    (length,) = struct.unpack(">i", recv_exact(sock, 4))
    payload = recv_exact(sock, length)
    correlation_id, error_code = struct.unpack(">ih", payload[:6])
    return correlation_id == 42 and error_code == 0


def redis(sock):
    sock.sendall(b"PING\r\n")
    return recv_exact(sock, 7) == b"+PONG\r\n"


def redis_tls(sock):
    sock.sendall(b"PING\r\n")
    return recv_exact(sock, 7) in (b"+PONG\r\n", b"-NOAUTH")


def main():
    kind, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    checks = {"cql": cql, "kafka": kafka, "redis": redis}
    checks.update({"cql-tls": cql, "kafka-tls": kafka, "redis-tls": redis_tls})
    check = checks[kind]
    try:
        with socket.create_connection((host, port), timeout=3) as raw:
            raw.settimeout(3)
            if kind.endswith("-tls"):
                context = ssl.create_default_context(cafile=os.environ["PROBE_CA"])
                with context.wrap_socket(raw, server_hostname=host) as sock:
                    ok = check(sock)
            else:
                ok = check(raw)
    except (OSError, ConnectionError, struct.error, KeyError):
        ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

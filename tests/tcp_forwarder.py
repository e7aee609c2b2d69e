"""A TCP forwarder, run as its own process: `python tests/tcp_forwarder.py LISTEN_PORT TARGET_PORT`.
Tests use it as a second address of a real server, so that killing this process is a server that
dies mid-request (connections cut, the address refusing) while the real server goes on."""

import socket
import sys
import threading


def pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for sock in (source, sink):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def main(listen_port: int, target_port: int) -> None:
    listener = socket.create_server(("127.0.0.1", listen_port))
    while True:
        client, _ = listener.accept()
        upstream = socket.create_connection(("127.0.0.1", target_port))
        for source, sink in ((client, upstream), (upstream, client)):
            threading.Thread(target=pipe, args=(source, sink), daemon=True).start()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

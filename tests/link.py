"""A TCP relay on loopback in front of an RPC server that counts the bytes crossing it, each
way: the link between the engine and its peer stage, measured."""

from __future__ import annotations

import socket
import threading


class CountingLink:
    def __init__(self, target_port: int) -> None:
        self.sent = 0  # bytes to the server (commands, tensors set)
        self.received = 0  # bytes from it (answers, tensors read)
        self._lock = threading.Lock()
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self._lsock.getsockname()[1]
        self._target = target_port
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def both(self) -> int:
        with self._lock:
            return self.sent + self.received

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._lsock.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self._target))
            except OSError:  # the server is gone: the client sees its connection end
                client.close()
                continue
            for a, b, to_server in ((client, server, True), (server, client, False)):
                threading.Thread(target=self._pump, args=(a, b, to_server), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket, to_server: bool) -> None:
        try:
            while data := a.recv(1 << 16):
                with self._lock:
                    if to_server:
                        self.sent += len(data)
                    else:
                        self.received += len(data)
                b.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (a, b):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        """Stop listening for good: later connections are refused, as by a server that is gone
        (a listener closed under a blocked accept() would queue them unanswered)."""
        try:
            self._lsock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._lsock.close()

"""A TCP relay on loopback that counts the bytes crossing it both ways: put between the engine
and its RPC stage, it measures what a step, a save or a restore sends over the link."""

from __future__ import annotations

import socket
import threading


class LinkMeter:
    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._lock = threading.Lock()
        self.n_bytes = 0
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._srv.getsockname()[1]}"
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            server = socket.create_connection(self.target)
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                with self._lock:
                    self.n_bytes += len(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def read(self) -> int:
        with self._lock:
            return self.n_bytes

    def close(self) -> None:
        self._srv.close()
        for s in self._socks:
            s.close()

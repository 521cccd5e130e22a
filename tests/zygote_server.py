"""The zygote itself: ``python tests/zygote_server.py SOCKET PRELOAD``, started by tests/zygote.py
(which describes what a forked child is, and holds the client side).

It imports the modules the JSON list ``PRELOAD`` names, listens on the Unix socket ``SOCKET``
and, for each request, forks a child that becomes ``python [-m] target args`` would. It ends
when its standard input closes (the test process ended). A request is one JSON message with the
child's three standard streams passed along as file descriptors; the reply is ``{"pid": ...}``,
then, on the same connection, ``{"code": ...}`` once the child ended (its exit code, or minus
the signal that killed it). ``{"query": true}`` is answered with the pid of the process that
asked for each living child.

This file is run, never imported, and must stay cheap: the standard library modules below (all
of which torch imports too) and the preloads are all the zygote imports, never Zephon nor
anything of tests/, since whatever it imports every child starts with.
"""

import contextlib
import io
import json
import os
import runpy
import selectors
import socket
import struct
import sys
import traceback


class Zygote:
    def __init__(self, address: str) -> None:
        # the installation's: the zygote runs with no PYTHONPATH, and its own folder is gone
        self.base_path = sys.path[:]
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(address)
        self.listener.listen(64)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        # closed: the test process ended
        self.selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
        self.children: dict[int, socket.socket] = {}  # pid -> the connection that asked for it
        self.requested_by: dict[int, int] = {}  # pid -> the pid of the process that asked for it

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select(timeout=0.02):
                if key.data == "stdin":
                    if not os.read(sys.stdin.fileno(), 4096):
                        sys.exit(0)
                elif key.data == "accept":
                    conn, _ = self.listener.accept()
                    self.selector.register(conn, selectors.EVENT_READ, "request")
                else:
                    self.start(key.fileobj)
            self.reap()

    def reap(self) -> None:
        """Tell each ended child's requester its exit code."""
        while self.children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            self.requested_by.pop(pid, None)
            conn = self.children.pop(pid, None)
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.send(json.dumps({"code": os.waitstatus_to_exitcode(status)}).encode())
                conn.close()

    def start(self, conn: socket.socket) -> None:
        """Answer one request on ``conn``: fork the child it asks for (or answer a query)."""
        message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        if not message:
            self.selector.unregister(conn)
            conn.close()
            return
        request = json.loads(message)
        if request.get("query"):  # which process asked for each living child
            conn.send(json.dumps({"requested_by": self.requested_by}).encode())
            return
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        requester = struct.unpack("3i", creds)[0]
        pid = os.fork()
        if pid == 0:
            try:
                self.become(request, fds)
            except SystemExit:
                raise
            except BaseException:
                traceback.print_exc()
                os._exit(70)
        for fd in fds:
            os.close(fd)
        conn.send(json.dumps({"pid": pid}).encode())
        self.children[pid] = conn
        self.requested_by[pid] = requester
        self.selector.unregister(conn)

    def become(self, request: dict, fds: list[int]) -> None:
        """In the child: become ``python [-m] target args`` as ``request`` describes, with
        ``fds`` as standard streams; ends by raising SystemExit with its exit code."""
        for key in list(self.selector.get_map().values()):
            if key.data != "stdin":
                key.fileobj.close()
        for target, fd in zip((0, 1, 2), fds, strict=False):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        if request["new_session"]:
            os.setsid()
        os.chdir(request["cwd"])
        options = request["env"].get("PYTHONWARNINGS")
        if options and options != os.environ.get("PYTHONWARNINGS"):  # read at start: apply them
            import warnings

            warnings._processoptions([o for o in options.split(",") if o])
        os.environ.clear()
        os.environ.update(request["env"])
        if "tempfile" in sys.modules:  # chosen from the zygote's TMPDIR when a preload asked
            sys.modules["tempfile"].tempdir = None
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
        module, args = request.get("module"), request["args"]
        unbuffered = request["unbuffered"]
        first = os.getcwd() if module else os.path.dirname(os.path.abspath(request["script"]))
        sys.path[:] = [first, *extra, *self.base_path]
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        if unbuffered:  # python -u
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
            sys.stderr = io.TextIOWrapper(
                io.FileIO(2, "w", closefd=False), errors="backslashreplace", write_through=True
            )
        else:
            sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", closefd=False, errors="backslashreplace")  # noqa: SIM115
        sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
        try:
            if module:
                sys.argv = ["-m", *args]
                runpy.run_module(module, run_name="__main__", alter_sys=True)
            else:
                sys.argv = [request["script"], *args]
                runpy.run_path(request["script"], run_name="__main__")
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            raise SystemExit(1) from None
        raise SystemExit(0)


def main(address: str, preload: list[str]) -> None:
    # Python put this file's folder first on sys.path: tests/, whose helpers neither a preload
    # nor a child may find there (a child's sys.path is computed afresh in ``become``)
    del sys.path[0]
    for name in preload:
        __import__(name)
    Zygote(address).serve()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))

"""torchrun (`torch.distributed.run`) with three additions for hetsim's runs:

    python -m hetsim.execution.launcher <torchrun arguments>

1. Loopback only.  torch's TCPStore server listens on every interface ('::'),
   even when the rendezvous endpoint is 127.0.0.1 (seen with torch 2.14: both
   the rendezvous store and the workers' store).  For a loopback endpoint this
   module binds the listening socket to 127.0.0.1 itself and hands it to the
   store (`master_listen_fd`), so a local run opens no port to the network.
   Endpoints the user gives (`--rdzv-endpoint HOST:PORT`) are left as torch
   makes them: other nodes must reach them.
2. No orphans.  On Linux the launcher asks to receive SIGTERM when the process
   that started it dies (even by SIGKILL); torchrun's SIGTERM handling then
   stops every worker.
3. A quick exit.  Once torchrun's `main()` has returned (every worker ended), the
   launcher ends with `os._exit(0)`, skipping the interpreter's teardown of torch
   (about 1 s a run on two CPU cores); a failure still exits as torchrun makes it.

Everything else is torchrun's own `main()`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost"})


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os.kill(os.getpid(), sig)


def _loopback_listener(port: int) -> int:
    """A listening socket on 127.0.0.1:port (0: any free port); returns its file descriptor."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", port))
    s.listen(512)
    return s.detach()


def install_loopback_stores() -> None:
    """Make every TCPStore *server* for a loopback host listen on 127.0.0.1 only."""
    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend

    original = dist.TCPStore

    def tcp_store(host_name, port, world_size=None, is_master=False, *args, **kwargs):
        if is_master and host_name in LOOPBACK_HOSTS and kwargs.get("master_listen_fd") is None:
            kwargs["master_listen_fd"] = _loopback_listener(int(port))
        return original(host_name, port, world_size, is_master, *args, **kwargs)

    # The two places torchrun creates stores: the c10d rendezvous backend and the
    # dynamic rendezvous' store for the workers (through `dist.TCPStore`).
    dist.TCPStore = tcp_store
    c10d_rendezvous_backend.TCPStore = tcp_store


def main(argv: list[str] | None = None) -> None:
    die_with_parent()
    install_loopback_stores()
    from torch.distributed.run import main as torchrun_main

    torchrun_main(sys.argv[1:] if argv is None else argv)
    # Every worker has ended and torchrun has reported: skip the interpreter's teardown of torch
    # (about 1 s of a run's start-to-end on two CPU cores).  A failure raised above exits as before.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()

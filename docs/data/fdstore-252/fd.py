import os, socket, sys, time
def notify(msg, fds=()):
    import array
    addr = os.environ["NOTIFY_SOCKET"]
    if addr.startswith("@"): addr = "\0" + addr[1:]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    s.sendmsg([msg.encode()], anc, 0, addr); s.close()
n = int(os.environ.get("LISTEN_FDS", "0")) if os.environ.get("LISTEN_PID") == str(os.getpid()) else 0
if n:
    ls = socket.socket(fileno=3)
    print("fdx: got fd from the store:", os.environ.get("LISTEN_FDNAMES"), ls.getsockname(), flush=True)
else:
    ls = socket.socket(); ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", 9000)); ls.listen(64)
    notify("FDSTORE=1\nFDNAME=client", [ls.fileno()])
    print("fdx: bound and stored", flush=True)
time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)  # a slow start
notify("READY=1")
while True:
    c, _ = ls.accept(); c.sendall(b"hi\n"); c.close()

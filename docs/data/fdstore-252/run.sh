#!/bin/bash
cat >/etc/systemd/system/fdx.service <<U
[Service]
Type=notify
NotifyAccess=main
FileDescriptorStoreMax=4
ExecStart=/usr/bin/python3 /fdx/fd.py 5
Restart=on-failure
RestartSec=3
U
systemctl daemon-reload
systemctl start fdx; echo "started: $(systemctl show -p MainPID --value fdx)"
probe() { python3 -c '
import socket,sys,time
t=time.time()
try:
    s=socket.create_connection(("127.0.0.1",9000),timeout=60); d=s.recv(10); print("answered", d, round(time.time()-t,1))
except Exception as e: print("error", type(e).__name__, round(time.time()-t,1))'; }
echo "== systemctl restart (the new one takes 5 s to READY)"
systemctl restart --no-block fdx; sleep 0.5; probe
echo "== kill -9 (RestartSec=3 + 5 s)"
systemctl kill -s KILL --kill-who=main fdx; sleep 0.5; probe
echo "== stop then start"
systemctl stop fdx; probe
systemctl start fdx
journalctl -u fdx -o cat --no-pager | grep fdx:
systemctl --version | head -1

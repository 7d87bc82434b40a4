"""A few requests to `lmrr serve` with the standard library only (the GPU
machine has no `openai`): greedy, sampled with a seed, and a stream cancelled
after 20 chunks. Used by scripts/device-check.sh.

    python3 scripts/serve_device_client.py PORT
"""
import json
import socket
import sys
import time
import urllib.request

port = int(sys.argv[1])
url = f"http://127.0.0.1:{port}"
for _ in range(600):
    try:
        urllib.request.urlopen(url + "/health", timeout=1)
        break
    except OSError:
        time.sleep(0.2)
M = json.load(urllib.request.urlopen(url + "/v1/models"))["data"][0]["id"]


def post(body):
    r = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                               {"Content-Type": "application/json"})
    return json.load(urllib.request.urlopen(r, timeout=600))


ask = "write a tic tac toe html page"
print(post({"model": M, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
            "temperature": 0})["lmrr"])
b = json.dumps({"model": M, "messages": [{"role": "user", "content": ask}], "max_tokens": 300,
                "temperature": 0, "stream": True, "ignore_eos": True}).encode()
s = socket.create_connection(("127.0.0.1", port))
s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
          b"Content-Length: %d\r\n\r\n" % len(b) + b)
data = b""
while data.count(b"data: ") < 20:
    chunk = s.recv(4096)
    if not chunk:
        break
    data += chunk
s.close()
time.sleep(1)
print(post({"model": M, "temperature": 0.8, "seed": 3, "max_tokens": 20,
            "messages": [{"role": "user", "content": ask}, {"role": "assistant", "content": "<html>"},
                         {"role": "user", "content": "to a file"}]})["lmrr"])

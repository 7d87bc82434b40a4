"""The incident's conversation through `lmrr proxy` with the `openai` client.

A user states two facts and asks for a poem (a short first try, then the
same message again, streamed and cancelled after 30 chunks), says "to a
file" with the history the client saw, then asks for the facts back.
Greedy (temperature 0) so that every engine's answer is its own argmax.

    python scripts/proxy_clients.py BASE_URL [MODEL]
"""
import sys

import openai

base = sys.argv[1]
model = sys.argv[2] if len(sys.argv) > 2 else "smollm2"
client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=300)
# llama.cpp's server applies a repeat penalty of 1.1 unless told otherwise: a
# sampler setting, not the model's distribution. Greedy means argmax here.
greedy = {"temperature": 0, "extra_body": {"repeat_penalty": 1.0}}

facts = "My name is Zorblax and my favourite colour is teal. Please write a short poem about the sea."
user = {"role": "user", "content": facts}

# 1. first try, not streamed
r = client.chat.completions.create(model=model, messages=[user], max_tokens=4, **greedy)
print("first-try:", repr(r.choices[0].message.content))
assert r.choices[0].logprobs is None, "the proxy must strip the logprobs it asked for"

# 2. the retry, streamed and cancelled after 30 chunks
stream = client.chat.completions.create(
    model=model, messages=[user], max_tokens=200, **greedy, stream=True
)
seen, chunks = "", 0
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        assert chunk.choices[0].logprobs is None
        seen += chunk.choices[0].delta.content
        chunks += 1
        if chunks == 30:
            break
stream.close()
print(f"poem (cancelled after {chunks} chunks):", repr(seen))

# 3. "to a file", with the history the client saw
history = [user, {"role": "assistant", "content": seen}, {"role": "user", "content": "to a file"}]
out = ""
for chunk in client.chat.completions.create(
    model=model, messages=history, max_tokens=40, **greedy, stream=True
):
    if chunk.choices and chunk.choices[0].delta.content:
        out += chunk.choices[0].delta.content
print("to-a-file:", repr(out))

# 4. recall
history += [
    {"role": "assistant", "content": out},
    {"role": "user", "content": "What is my name and my favourite colour?"},
]
r = client.chat.completions.create(model=model, messages=history, max_tokens=40, **greedy)
print("recall:", repr(r.choices[0].message.content))

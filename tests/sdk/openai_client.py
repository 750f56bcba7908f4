"""The OpenAI Python SDK, unchanged, against the router (run by tests/sdk.rs):
chat completions, and a Responses API loop chained by previous_response_id,
streaming and not, then retrieve and delete. Exits non-zero on any failure.
  python tests/sdk/openai_client.py http://127.0.0.1:PORT
"""
import sys

import openai

client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)

chat = client.chat.completions.create(
    model="sim", max_tokens=2, messages=[{"role": "user", "content": "hello"}])
assert chat.choices[0].message.content == "tok tok", chat

ids = []
previous = None
for turn in range(4):
    if turn % 2 == 0:
        r = client.responses.create(model="sim", input=f"turn {turn}", max_output_tokens=2,
                                    previous_response_id=previous)
        assert r.output_text == "tok tok", r
        previous = r.id
    else:
        events = list(client.responses.create(model="sim", input=f"turn {turn}", max_output_tokens=3,
                                              previous_response_id=previous, stream=True))
        kinds = [e.type for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == "tok tok tok", text
        previous = events[-1].response.id
    ids.append(previous)

assert client.responses.retrieve(previous).id == previous
client.responses.delete(previous)
try:
    client.responses.retrieve(previous)
    raise AssertionError("deleted response still there")
except openai.NotFoundError:
    pass
print("ok", len(ids), "chained responses")

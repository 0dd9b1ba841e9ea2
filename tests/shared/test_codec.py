from shared import codec


def test_msgpack_round_trip_matches_json():
    batch = {"step": 3, "samples": [{"prompt_token_ids": [1, 2, 3], "reward": 0.5, "rewards": {"a": 1.0},
                                     "completion_logprobs": [-0.1, -2.5], "finish_reason": "stop"}]}
    assert codec.unpack(codec.pack(batch)) == batch
    assert codec.decode(codec.MSGPACK, codec.pack(batch)) == codec.decode(codec.JSON, codec.dumps_json(batch))


def test_accept_negotiation():
    assert codec.wants_msgpack("application/msgpack")
    assert codec.wants_msgpack("application/x-msgpack, */*")
    assert not codec.wants_msgpack("application/json")
    assert not codec.wants_msgpack(None)

"""Tasks and rewards: the protocol, Addition, Math and its data, the benchmarks, answer extraction, the verifier."""

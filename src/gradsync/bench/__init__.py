"""``gradsync bench``: several algorithms on the same workload and network, interleaved, one report."""

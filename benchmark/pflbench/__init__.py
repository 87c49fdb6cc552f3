"""pflbench: benchmark suite and leaderboard harness for private federated learning of ASR."""

__version__ = "0.1.0"

"""Where ``source[i]`` runs: the consumer's threads or worker processes."""

"""The fault matrix: real `gracelm serve` processes, real signals and faults; nothing is left."""

"""The fault matrix: real `gracelm serve` processes, real signals and faults; each case ends with nothing left."""

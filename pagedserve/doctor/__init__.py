"""`pagedserve doctor`: read a live server's metrics (or a `bench serve` result) and say what is
wrong, with the evidence and the flag to change."""

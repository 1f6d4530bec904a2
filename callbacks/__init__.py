"""Lightning callbacks: live speculative-decoding validation."""

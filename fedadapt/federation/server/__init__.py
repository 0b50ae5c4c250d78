"""The server's side: the round loop and the ServerApp around it (loop), checkpoints written and
verified (checkpoint), clean stops on signals (interrupt), failing clients screened and injected
(faults), and the original model trained on the server before the rounds (original)."""

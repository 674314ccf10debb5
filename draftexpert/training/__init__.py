"""Training of draft experts: self-distillation from the frozen target (`distill`)."""

"""One job on several processes: torch.distributed groups, their launch, and the followers' loop."""

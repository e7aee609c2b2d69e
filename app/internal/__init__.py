"""The internal API that workers use (they hold no database credentials): job leases with
heartbeats, file contents, and idempotent pushes of metrics, events, rollouts, checkpoints and
training state; plus the watchdog that re-queues jobs whose worker went silent."""

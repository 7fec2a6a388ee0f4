"""Multi-path host-to-device transfer: a transfer engine, path discovery, an adaptive copier, a simulator."""

"""The pure scheduling core: state and events in, actions out. No I/O here."""

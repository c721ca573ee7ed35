"""The control plane: the listener, control links, the hello, the peer book, the queue pairs peers ask for."""

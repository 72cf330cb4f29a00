"""One screen per workflow: browser, call view, bisect session, help, and the small dialogs."""

"""The studies behind the README's numbers, one folder (or script) each. A script puts the repo root on sys.path
once and imports what another study shares as `experiments.<study>.<module>`: run them from anywhere as
`python experiments/<study>/<script>.py`."""

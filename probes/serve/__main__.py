from probes.serve.cli import main

main()

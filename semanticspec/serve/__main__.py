from semanticspec.serve.cli import main

main()

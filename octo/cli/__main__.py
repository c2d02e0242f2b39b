from octo.cli.main import main

main()

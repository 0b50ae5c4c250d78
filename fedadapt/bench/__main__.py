from fedadapt.bench import main

main()

package stack

// Stack holds ints.
type Stack struct {
	items []int
}

// Push adds v on top.
func (s *Stack) Push(v int) {
	s.items = append(s.items, v)
}

// Pop removes the top item.
func (s *Stack) Pop() int {
	v := s.items[len(s.items)-1]
	s.items = s.items[:len(s.items)-1]
	return v
}

func New() *Stack {
	return &Stack{}
}

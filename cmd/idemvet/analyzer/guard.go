package analyzer

import (
	"go/ast"
	"go/token"
	"go/types"
)

// Code that runs only when there is no attempt's transaction is not in an
// attempt, so rule pool-write leaves it alone:
//
//	tx, ok := middleware.PgxTxFromContext(ctx)
//	if !ok {
//		return pool.Exec(…) // not reported: no attempt here
//	}
//
// noAttempt returns the ranges of body that run only when an accessor's ok
// result is false: the branch of an if on ok (or !ok) taken when it is
// false, and the statements after an if on ok whose branch for true ends
// in a return.
func (c *checker) noAttempt(body *ast.BlockStmt) []posRange {
	okVars := make(map[types.Object]bool)
	ast.Inspect(body, func(n ast.Node) bool {
		if as, ok := n.(*ast.AssignStmt); ok && len(as.Lhs) == 2 && len(as.Rhs) == 1 {
			if call, ok := ast.Unparen(as.Rhs[0]).(*ast.CallExpr); ok && isFuncRef(c.callee(call), attemptTxAccessors) {
				if v := c.varOf(as.Lhs[1]); v != nil {
					okVars[v] = true
				}
			}
		}
		return true
	})
	if len(okVars) == 0 {
		return nil
	}
	// okTest returns whether cond is ok (true) or !ok (false).
	okTest := func(cond ast.Expr) (positive, matched bool) {
		cond = ast.Unparen(cond)
		if u, isNot := cond.(*ast.UnaryExpr); isNot && u.Op == token.NOT {
			if v := c.varOf(u.X); v != nil && okVars[v] {
				return false, true
			}
			return false, false
		}
		if v := c.varOf(cond); v != nil && okVars[v] {
			return true, true
		}
		return false, false
	}
	var out []posRange
	list := func(stmts []ast.Stmt, end token.Pos) {
		for i, st := range stmts {
			ifs, ok := st.(*ast.IfStmt)
			if !ok {
				continue
			}
			positive, matched := okTest(ifs.Cond)
			if !matched {
				continue
			}
			if !positive {
				out = append(out, posRange{ifs.Body.Pos(), ifs.Body.End()})
				continue
			}
			if ifs.Else != nil {
				out = append(out, posRange{ifs.Else.Pos(), ifs.Else.End()})
			} else if returns(ifs.Body) && i+1 < len(stmts) {
				out = append(out, posRange{stmts[i+1].Pos(), end})
			}
		}
	}
	ast.Inspect(body, func(n ast.Node) bool {
		switch n := n.(type) {
		case *ast.BlockStmt:
			list(n.List, n.End())
		case *ast.CaseClause:
			list(n.Body, n.End())
		case *ast.CommClause:
			list(n.Body, n.End())
		}
		return true
	})
	return out
}

type posRange struct{ pos, end token.Pos }

func within(rs []posRange, p token.Pos) bool {
	for _, r := range rs {
		if r.pos <= p && p < r.end {
			return true
		}
	}
	return false
}

// returns reports whether a block ends in a return or a panic.
func returns(b *ast.BlockStmt) bool {
	if len(b.List) == 0 {
		return false
	}
	switch last := b.List[len(b.List)-1].(type) {
	case *ast.ReturnStmt:
		return true
	case *ast.ExprStmt:
		if call, ok := last.X.(*ast.CallExpr); ok {
			if id, ok := call.Fun.(*ast.Ident); ok && id.Name == "panic" {
				return true
			}
		}
	}
	return false
}
